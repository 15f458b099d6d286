// vitcam_nb exported Explorer (one HTML file, no kernel, no network). Python writes this file after core.js
// and explorer.js into one inline module, with the data in three inline elements (vitcam_nb/widgets/bundle.py):
//   #vc-meta  JSON: axes [[field, values]], controls, shapes, how maps are stored, the entry shown first
//   #vc-maps  base64 of zlib(image RGBA, [low, high] float32 per map when uint8, the quantised grids)
//   #vc-texts base64 of zlib(JSON list, one entry per combination of the axes, first axis slowest):
//             {g: map index, r: recipe JSON, id, c: checklist, md, m: methods, d: degenerate, n: notes} or {e}
//   of a video trace (meta.frames > 0): the image is every frame's RGBA (meta.frame_bytes each), an entry's g is
//   the map index of each frame and v the [low, high] of the whole clip's map; a `frame_request` shows another
//   frame of the clip and of the entry shown, as the kernel does.
//   with several traces of one image, #vc-meta also holds trace_choices, trace_shown and trace_parts (the meta of
//   each further trace's table), whose blobs are #vc-maps-1, #vc-texts-1, ... (the first trace's: the above).
// A local model stands in for the kernel: it answers the Explorer's `request` from the table, with the same
// traits the kernel sets, so explorer.js paints exactly as it does in a notebook. A draft outside the table (a
// value no entry holds, in a varied field or a fixed one) is answered with a refusal, as the kernel refuses.

async function inflate(base64) {
  const text = atob(base64);
  const bytes = new Uint8Array(text.length);
  for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate"));
  return new Uint8Array(await new Response(stream).arrayBuffer());
}

/** IEEE half-precision bits -> number. */
function halfToFloat(bits) {
  const sign = bits & 0x8000 ? -1 : 1;
  const exp = (bits >> 10) & 0x1f;
  const frac = bits & 0x3ff;
  if (exp === 0) return sign * frac * 2 ** -24;
  if (exp === 31) return frac ? NaN : sign * Infinity;
  return sign * (1 + frac / 1024) * 2 ** (exp - 15);
}

/** Map `index` of the stored grids as float32 little-endian bytes (what the kernel sends). */
function gridBytes(meta, maps, index) {
  const n = meta.grid_shape[0] * meta.grid_shape[1];
  const out = new Float32Array(n);
  const start = meta.image_bytes + meta.ranges_bytes;
  if (meta.quantize === "float32") {
    const view = new DataView(maps.buffer, maps.byteOffset + start + 4 * n * index, 4 * n);
    for (let i = 0; i < n; i++) out[i] = view.getFloat32(4 * i, true);
  } else if (meta.quantize === "float16") {
    const view = new DataView(maps.buffer, maps.byteOffset + start + 2 * n * index, 2 * n);
    for (let i = 0; i < n; i++) out[i] = halfToFloat(view.getUint16(2 * i, true));
  } else {
    const ranges = new DataView(maps.buffer, maps.byteOffset + meta.image_bytes, meta.ranges_bytes);
    const lo = ranges.getFloat32(8 * index, true);
    const hi = ranges.getFloat32(8 * index + 4, true);
    const step = hi > lo ? (hi - lo) / 255 : 0;
    const codes = maps.subarray(start + n * index, start + n * (index + 1));
    for (let i = 0; i < n; i++) out[i] = lo + codes[i] * step;
  }
  return new Uint8Array(out.buffer);
}

/** A stand-in for the widget model: get/set/save_changes/on/off, answering requests from the table. With several
 * traces of one image, `parts` holds one table per trace ({name, meta, maps, entries}, the first shown first) and
 * a `trace_request` switches table, keeping the recipe shown where the other table holds it (else a refusal). */
function localModel(parts) {
  const listeners = new Map();
  const meta = parts[0].meta;
  for (const p of parts) {
    p.keys = p.meta.axes.map(([, values]) => new Map(values.map((v, i) => [JSON.stringify(v), i])));
    p.varied = new Set(p.meta.axes.map(([field]) => field));
  }
  let part = parts[0];
  const frames = meta.frames || 0;
  // The pixels of frame `f` (of an image trace: the image).
  const picture = (p, f) => (frames ? p.maps.subarray(f * p.meta.frame_bytes, (f + 1) * p.meta.frame_bytes)
    : p.maps.subarray(0, p.meta.image_bytes));
  const state = {
    options: meta.options, image: picture(part, 0), image_shape: meta.image_shape,
    size: meta.size, opacity: meta.opacity, colormap: meta.colormap, images: [], image_index: 0,
    trace_choices: meta.trace_choices || [], trace_shown: meta.trace_shown || "", frames, frame_shown: 0,
    response_id: 0, frame: 0, error: "", request: {}, image_request: {}, trace_request: {}, frame_request: {},
  };
  let current = part.entries[meta.start]; // the entry shown
  const shown = (entry, p = part, f = state.frame_shown) => {
    current = entry;
    return {
      recipe_json: entry.r, recipe_id: entry.id, grid: gridBytes(p.meta, p.maps, frames ? entry.g[f] : entry.g),
      grid_shape: p.meta.grid_shape, value_range: entry.v || [], checklist: entry.c, checklist_md: entry.md,
      methods: entry.m, degenerate: entry.d, notes: entry.n, error: "",
    };
  };
  Object.assign(state, shown(current));

  function update(changes) {
    const changed = Object.keys(changes).filter((k) => state[k] !== changes[k]);
    Object.assign(state, changes);
    for (const key of changed) for (const fn of listeners.get(`change:${key}`) || []) fn();
  }

  // The index of a draft in a table (the axes in order, first slowest), or a message why it is not there.
  function lookup(draft, p = part) {
    const m = p.meta;
    let index = 0;
    for (let a = 0; a < m.axes.length; a++) {
      const [field, values] = m.axes[a];
      let value = draft[field];
      if (field === "layer" && Number.isInteger(value)) value = ((value % m.num_layers) + m.num_layers) % m.num_layers;
      const pos = p.keys[a].get(JSON.stringify(value));
      if (pos === undefined) {
        return `${field} = ${JSON.stringify(value)} is not in this file (it holds ${values.map((v) => JSON.stringify(v)).join(", ")})`;
      }
      index = index * values.length + pos;
    }
    return index;
  }

  // A field the file does not vary holds one value in every entry: a draft (e.g. a preset) that asks for another
  // value of a field that applies is not in the file, rather than shown as the entry's own recipe.
  function fixedFieldMiss(draft, entry, p = part) {
    if (entry.r === undefined) return null;
    const stored = JSON.parse(entry.r);
    const layerOf = (v) => (Number.isInteger(v) ? ((v % p.meta.num_layers) + p.meta.num_layers) % p.meta.num_layers : v);
    for (const field of p.meta.options.fields) {
      const name = field.name;
      if (p.varied.has(name) || !(name in draft) || !applies(field.when, draft)) continue;
      const norm = name === "layer" ? layerOf : (v) => v;
      if (JSON.stringify(norm(draft[name])) !== JSON.stringify(norm(stored[name]))) {
        const [want, have] = [JSON.stringify(draft[name]), JSON.stringify(stored[name])];
        return `${name} = ${want} is not in this file (it holds ${have} only)`;
      }
    }
    return null;
  }

  // The entry of a draft in a table: {g, r, ...} or {e: why not}.
  function entryOf(draft, p = part) {
    const index = lookup(draft, p);
    const entry = typeof index === "number" ? p.entries[index] : { e: index };
    const miss = fixedFieldMiss(draft, entry, p);
    return miss ? { e: miss } : entry;
  }

  function answer(request) {
    const id = Math.max(Number(request.id) || 0, state.response_id);
    const entry = entryOf(request.recipe || {});
    if (entry.e !== undefined) update({ error: entry.e, response_id: id, frame: state.frame + 1 });
    else update({ ...shown(entry), response_id: id, frame: state.frame + 1 });
  }

  // A switch of trace keeps the recipe shown: the other table's entry of that very recipe, or a refusal.
  function switchTrace(request) {
    const other = parts.find((p) => p.name === request.name);
    if (other === part) return;
    let entry = other ? entryOf(JSON.parse(state.recipe_json), other)
      : { e: `trace: expected one of ${JSON.stringify(parts.map((p) => p.name))}, got ${JSON.stringify(request.name)}` };
    if (entry.e === undefined && entry.r !== state.recipe_json) entry = { e: "the recipe shown is not in this file" };
    if (entry.e !== undefined) {
      update({ error: `trace ${JSON.stringify(request.name)}: ${entry.e}`, frame: state.frame + 1 });
      return;
    }
    part = other;
    update({ options: other.meta.options, trace_shown: other.name, ...shown(entry), frame: state.frame + 1 });
  }

  // Another frame of the clip under the same frame of the map shown; refused as the kernel refuses it.
  function showFrame(request) {
    const f = request.index;
    if (!frames || !Number.isInteger(f) || f < 0 || f >= frames) {
      const allowed = frames ? `an int in [0, ${frames - 1}] (the clip has ${frames} frames)` : "0 (an image trace)";
      update({ error: `IndexError: frame: expected ${allowed}, got ${JSON.stringify(f)}`, frame: state.frame + 1 });
      return;
    }
    update({ image: picture(part, f), frame_shown: f, ...shown(current, part, f), frame: state.frame + 1 });
  }

  return {
    get: (name) => state[name],
    set: (name, value) => {
      if (name.endsWith("request")) state[name] = value;
      else update({ [name]: value });
    },
    save_changes: () => {
      const [request, traceRequest, frameRequest] = [state.request, state.trace_request, state.frame_request];
      state.request = {};
      state.trace_request = {};
      state.frame_request = {};
      if (traceRequest && traceRequest.id !== undefined) switchTrace(traceRequest);
      if (frameRequest && frameRequest.id !== undefined) showFrame(frameRequest);
      if (request && request.id !== undefined) answer(request);
    },
    on: (event, fn) => listeners.set(event, [...(listeners.get(event) || []), fn]),
    off: (event, fn) => listeners.set(event, (listeners.get(event) || []).filter((f) => f !== fn)),
    lookup,
  };
}

/** Embedded in a frame (the documentation site's Explorer page), tell the page holding it how tall this page is,
 * now and whenever it changes (a paragraph opened, the controls wrapped under the image), so the frame can show
 * every control: a page cannot read the size of a file:// frame's document, and a fixed height cuts it off or
 * leaves a gap. Only a number is sent. */
function reportHeight() {
  if (window.parent === window || typeof ResizeObserver === "undefined") return;
  let last = -1;
  const post = () => {
    const box = document.body.getBoundingClientRect();
    const height = Math.ceil(box.bottom + window.scrollY + parseFloat(getComputedStyle(document.body).marginBottom));
    if (height === last) return;
    last = height;
    window.parent.postMessage({ vitcam: "explorer-height", height }, "*");
  };
  new ResizeObserver(post).observe(document.body);
  post();
}

async function mountExported() {
  const host = document.getElementById("vc-app");
  try {
    if (typeof DecompressionStream === "undefined") throw new Error("this browser has no DecompressionStream");
    const meta = JSON.parse(document.getElementById("vc-meta").textContent);
    const metas = [meta, ...(meta.trace_parts || [])];
    const names = (meta.trace_choices || [["", ""]]).map(([name]) => name);
    const parts = [];
    for (let i = 0; i < metas.length; i++) {
      const suffix = i ? `-${i}` : "";
      const maps = await inflate(document.getElementById(`vc-maps${suffix}`).textContent.trim());
      const texts = await inflate(document.getElementById(`vc-texts${suffix}`).textContent.trim());
      parts.push({ name: names[i], meta: metas[i], maps, entries: JSON.parse(new TextDecoder().decode(texts)) });
    }
    const model = localModel(parts);
    window.vitcamExplorer = model;
    render({ model, el: host });
    document.body.dataset.loaded = "true";
  } catch (err) {
    host.append(h("p", { className: "vc-error", textContent: `The explorer could not start: ${err.message}` }));
    document.body.dataset.loaded = "error";
  }
  reportHeight();
}

mountExported();
