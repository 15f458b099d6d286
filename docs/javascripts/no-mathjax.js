// The notebooks hold no LaTeX; nbconvert's template still asks for a MathJax script, which would otherwise be
// loaded from a CDN. This empty local file keeps the site offline.
