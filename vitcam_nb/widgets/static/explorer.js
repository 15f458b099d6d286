// vitcam_nb Explorer view. Protocol with the kernel (vitcam_nb/widgets/explorer.py):
//   page -> kernel: `request` = {id, recipe, changed}   (sent at once when idle, else debounced; ids increase)
//   kernel -> page: recipe_json, grid (float32 LE bytes), grid_shape, checklist, methods, recipe_id,
//                   degenerate, notes, error, response_id (the request answered), frame (+1 per answer)
//   with a many-image store: `images` ([label, position] per image); the picker sends `image_request` =
//   {id, index}; the kernel answers in one message with the new image, options, map (the recipe is kept)
//   and `image_index` (the image shown), or with `error` (the image shown stays).
//   with several traces of one image: `trace_choices` ([name, label] per trace); the trace picker sends
//   `trace_request` = {id, name}; the kernel answers in one message with options, map (the recipe is kept) and
//   `trace_shown` (the trace shown, also root.dataset.trace), or with `error` (the trace shown stays).
//   with a video trace: `frames` (the clip's frame count, 0 for an image) and `value_range` (the [low, high] of the
//   whole clip's map, so every frame is coloured on one scale); the frame slider sends `frame_request` = {id, index};
//   the kernel answers in one message with that frame's image and map (the recipe is kept) and `frame_shown`
//   (also root.dataset.frameShown), or with `error` (the frame shown stays). A video map arrives at the clip's
//   pixel size, already upsampled as vc.cam gives it: the page enlarges its pixels (nearest), nothing else.
// An answer whose response_id is older than the newest request sent is stale and never painted.
// The controls always show the recipe of the map on screen: a refused request (a combination the kernel or the
// exported file cannot give, e.g. a preset) puts the controls back at the shown recipe, repaints its map if a
// cached view had replaced it, and says what was refused. root.dataset.paintedRecipeId names the map on the
// canvas. A degenerate map's notice starts with a badge naming its cause (options.degenerate_causes).
// Prefetch: after each answer the kernel sends a custom message {kind: "prefetch", entries} (one grid buffer
// per entry): the views one step away on the layer slider and the site list, each keyed by the draft the page
// would send. A control change whose draft is cached paints at once from the cache; the request still goes
// out (Python's recipe follows the page) and its answer, the same recipe, only refreshes the report.
// data-last-cached-paint-ms: control event to the end of the draw of a cached view.
// Timing hook for benchmarks: the root element's data-last-paint-latency-ms is the time from the first
// control event of a request to the end of the canvas draw of its answer (kernel round trip included), split
// into data-last-wait-ms (event to send: the debounce), data-last-round-trip-ms (send to the answer's arrival)
// and the rest (report and draw; data-last-draw-ms is the draw alone).

function render({ model, el }) {
  const options = model.get("options");
  const debounceMs = options.debounce_ms ?? 30;
  const root = h("div", { className: "vc-widget vc-explorer", dataset: { paintCount: "0" }, attrs: SUPPRESS_SHORTCUTS });
  el.append(root);

  let draft = JSON.parse(model.get("recipe_json") || "{}");
  let latest = model.get("response_id");
  let timer = null;
  let queued = false; // a send is queued for the end of the current task
  let lastSent = -Infinity;
  let t0 = null;
  const changed = new Set();
  const started = new Map();
  let image = imageCanvas(model.get("image"), model.get("image_shape"));
  const cache = new Map();
  const CACHE_SIZE = 64;
  let shownFromCache = null;
  let pending = 0;
  let painted = null; // the recipe id of the map on the canvas
  const keyOf = (d) => JSON.stringify(Object.keys(d).sort().map((k) => [k, d[k]]));
  const fromModel = (k) => (k === "grid" ? floatsOf(model.get("grid")) : model.get(k));

  // -- layout ------------------------------------------------------------------------------------
  const recipeId = h("code", { className: "vc-recipe-id" });
  const status = h("span", { className: "vc-status" });
  const picker = imagePicker();
  const tracePick = tracePicker();
  const presetMenu = presetPicker();
  const frameSlider = framePicker();
  const header = h("div", { className: "vc-header" },
    h("strong", { textContent: "vitcam_nb Explorer" }), picker, tracePick, presetMenu, h("span", { textContent: " recipe " }),
    recipeId,
    copyButton("copy recipe JSON", () => model.get("recipe_json")), status);
  const canvas = h("canvas", { className: "vc-canvas" });
  const bar = h("div", { className: "vc-colorbar-slot" });
  const display = displayControls(model, options.colormaps, () => paint());
  const errorBox = h("div", { className: "vc-error", hidden: true, attrs: { role: "alert" } });
  const degenerateBox = h("div", { className: "vc-degenerate", hidden: true, attrs: { role: "status" } });
  const notesBox = h("div", { className: "vc-notes", hidden: true });
  const view = h("div", { className: "vc-view" }, canvas, bar, frameSlider && frameSlider.node, display.node);
  const controlsNode = h("div", { className: "vc-controls" });
  let controls = recipeControls(controlsNode, options.fields, onControl);
  const methods = h("p", { className: "vc-methods" });
  const checklistSlot = h("div", { className: "vc-checklist-slot" });
  const report = h("div", { className: "vc-report" },
    h("details", { open: true },
      h("summary", {}, "Methods paragraph "), methods,
      copyButton("copy methods", () => model.get("methods"))),
    h("details", {},
      h("summary", {}, "Reporting checklist "), checklistSlot,
      copyButton("copy checklist (markdown)", () => model.get("checklist_md"))));
  root.append(header, errorBox, degenerateBox, notesBox,
    h("div", { className: "vc-main" }, view, controlsNode), report);

  // A store's image picker (null for a single trace); labels are inserted as text.
  function imagePicker() {
    const images = model.get("images") || [];
    if (!images.length) return null;
    const select = h("select", { className: "vc-image-picker", attrs: { "aria-label": "image" } });
    for (const [label, position] of images) {
      select.append(h("option", { value: String(position), textContent: label }));
    }
    select.value = String(model.get("image_index"));
    let requests = 0;
    select.addEventListener("change", () => {
      const index = Number(select.value);
      if (index === model.get("image_index")) return;
      root.dataset.state = "pending";
      status.textContent = "loading image…";
      model.set("image_request", { id: ++requests, index });
      model.save_changes();
    });
    return select;
  }

  // Several traces of one image (e.g. gradient and a backward rule; null for one trace): switching keeps the
  // recipe. Cached maps belong to the trace they came from, so the cache is emptied on every switch.
  function tracePicker() {
    const choices = model.get("trace_choices") || [];
    if (!choices.length) return null;
    const select = h("select", { className: "vc-trace-picker", attrs: { "aria-label": "trace" } });
    for (const [name, label] of choices) select.append(h("option", { value: name, textContent: label }));
    select.value = model.get("trace_shown");
    root.dataset.trace = model.get("trace_shown");
    let requests = 0;
    select.addEventListener("change", () => {
      if (select.value === model.get("trace_shown")) return;
      cache.clear();
      root.dataset.state = "pending";
      status.textContent = "loading trace…";
      model.set("trace_request", { id: ++requests, name: select.value });
      model.save_changes();
    });
    return select;
  }

  // A video trace's frame slider (null for an image trace): moving it asks for that frame; the recipe is kept.
  function framePicker() {
    const n = model.get("frames") || 0;
    if (!n) return null;
    const id = `vc-${Math.random().toString(36).slice(2)}`;
    const slider = h("input", { type: "range", id, min: 0, max: n - 1, step: 1, disabled: n < 2 });
    slider.dataset.field = "frame";
    const readout = h("output", { className: "vc-readout vc-frame-readout" });
    const say = (f) => (readout.textContent = `${f} of ${n} (0–${n - 1})`);
    let requests = 0;
    slider.addEventListener("input", () => {
      say(Number(slider.value));
      root.dataset.state = "pending";
      model.set("frame_request", { id: ++requests, index: Number(slider.value) });
      model.save_changes();
    });
    const sync = () => {
      slider.value = String(model.get("frame_shown"));
      say(model.get("frame_shown"));
      root.dataset.frameShown = String(model.get("frame_shown"));
    };
    sync();
    const node = h("div", { className: "vc-row vc-frame", dataset: { field: "frame" } },
      h("label", { textContent: "frame", htmlFor: id }), slider, readout);
    return { node, sync };
  }

  // The preset menu: choosing a published method sets every field of its recipe in one request.
  function presetPicker() {
    if (!(options.presets || []).length) return null;
    const select = h("select", { className: "vc-preset-picker", attrs: { "aria-label": "preset" } });
    fillPresets(select);
    select.addEventListener("change", () => {
      const chosen = (model.get("options").presets || []).find(([name]) => name === select.value);
      select.value = "";
      if (!chosen) return;
      onControls(chosen[2], true); // one request: no intermediate draft is sent or painted
    });
    return select;
  }

  // The menu offers the presets of the options shown (another trace of the image may offer others).
  function fillPresets(select) {
    select.replaceChildren(h("option", { value: "", textContent: "preset…" }));
    for (const [name, label] of model.get("options").presets || []) {
      select.append(h("option", { value: name, textContent: label }));
    }
  }

  // -- requests ----------------------------------------------------------------------------------
  // A change made while the page is idle (every request answered, none sent in the last debounce interval) is
  // sent at once, so a key press on a slider costs one round trip; slider input that follows while a request is
  // in flight is debounced (a drag sends one request per pause, not one per pixel). A select is always sent at
  // once. A send at once waits for the end of the current task, so that changes made in it travel as one request.
  function onControl(field, value, discrete = false) {
    onControls({ [field]: value }, discrete);
  }

  function onControls(changes, discrete = false) {
    const now = performance.now();
    draft = { ...draft, ...changes };
    for (const field of Object.keys(changes)) changed.add(field);
    if (t0 === null) t0 = now;
    const hit = model.get("prefetch") === false ? undefined : cache.get(keyOf(draft));
    shownFromCache = null;
    if (hit) {
      draft = JSON.parse(hit.recipe_json);
      showReport((k) => hit[k]);
      paint((k) => hit[k]);
      shownFromCache = hit.recipe_id;
      root.dataset.lastCachedPaintMs = (performance.now() - now).toFixed(2);
      root.dataset.cachedPaintCount = String(Number(root.dataset.cachedPaintCount || 0) + 1);
    }
    controls.sync(draft);
    root.dataset.state = "pending";
    status.textContent = hit ? "" : "computing…";
    if (queued) return; // the send queued for the end of this task carries this change too
    const idle = timer === null && model.get("response_id") >= latest && now - lastSent >= debounceMs;
    clearTimeout(timer);
    timer = null;
    if (discrete || idle) {
      queued = true;
      queueMicrotask(flush); // a zero-delay timer would wait for the next frame (measured: 12 ms)
    } else {
      timer = setTimeout(flush, debounceMs);
    }
  }

  function flush() {
    timer = null;
    queued = false;
    lastSent = performance.now();
    latest = Math.max(latest, model.get("response_id")) + 1;
    started.set(latest, [t0, lastSent]);
    t0 = null;
    root.dataset.requestId = String(latest);
    model.set("request", { id: latest, recipe: draft, changed: [...changed] });
    changed.clear();
    model.save_changes();
  }

  // -- answers -----------------------------------------------------------------------------------
  // A cached entry is painted through the same code as an answer: `get` reads either.
  function remember(key, entry) {
    cache.delete(key);
    cache.set(key, entry);
    if (cache.size > CACHE_SIZE) cache.delete(cache.keys().next().value);
  }

  function onCustom(msg, buffers) {
    if (!msg || msg.kind !== "prefetch") return;
    msg.entries.forEach((entry, i) => {
      const cached = { ...entry, grid: floatsOf(buffers[i]) };
      remember(keyOf(entry.draft), cached);
      pending += 1;
      root.dataset.prerenderPending = String(pending);
      setTimeout(() => { // one per task: a control event is never queued behind them all
        prerender(cached);
        pending -= 1;
        root.dataset.prerenderPending = String(pending);
      }, 0);
    });
    root.dataset.cacheSize = String(cache.size);
    root.dataset.prefetchCount = String(Number(root.dataset.prefetchCount || 0) + 1);
  }

  // What a painted overlay depends on besides the map: a prerendered one is reused only while these hold.
  const displayKey = (shown) => JSON.stringify([model.get("size"), model.get("colormap"), model.get("opacity"),
    shown.upsample, shown.normalize, model.get("image_shape")]);

  function overlayOptions(shown, get = fromModel) {
    const [ih, iw] = model.get("image_shape");
    const scale = Math.max(1, Math.ceil(model.get("size") / Math.max(iw, 1)));
    const video = model.get("frames") > 0; // the map is already upsampled, its range the clip's
    return { width: iw * scale, height: ih * scale, mode: video ? "nearest" : shown.upsample,
      normalize: shown.normalize, cmap: model.get("colormap"), opacity: model.get("opacity"),
      range: video ? get("value_range") : null };
  }

  // A prefetched view is drawn off screen while the page is idle, so showing it is one drawImage.
  function prerender(entry) {
    const shown = JSON.parse(entry.recipe_json);
    const off = document.createElement("canvas");
    const [gh, gw] = entry.grid_shape;
    const range = paintOverlay(off, image, entry.grid, gh, gw, overlayOptions(shown));
    entry.rendered = { key: displayKey(shown), canvas: off, range };
  }

  function paint(get = fromModel) {
    const [gh, gw] = get("grid_shape");
    const grid = get("grid");
    const shown = JSON.parse(get("recipe_json") || "{}");
    const rendered = get === fromModel ? null : get("rendered");
    const drawStart = performance.now();
    let lo, hi;
    if (rendered && rendered.key === displayKey(shown)) {
      canvas.width = rendered.canvas.width;
      canvas.height = rendered.canvas.height;
      canvas.getContext("2d").drawImage(rendered.canvas, 0, 0);
      [lo, hi] = rendered.range;
    } else {
      [lo, hi] = paintOverlay(canvas, image, grid, gh, gw, overlayOptions(shown, get));
    }
    canvas.style.width = `${model.get("size")}px`;
    bar.replaceChildren(colorbar(model.get("colormap"), lo, hi));
    root.dataset.lastDrawMs = (performance.now() - drawStart).toFixed(2);
    root.dataset.paintCount = String(Number(root.dataset.paintCount) + 1);
    painted = get("recipe_id");
    root.dataset.paintedRecipeId = painted;
  }

  function showReport(get = fromModel) {
    const error = get("error") || "";
    recipeId.textContent = get("recipe_id");
    root.dataset.recipeId = get("recipe_id");
    errorBox.hidden = !error;
    errorBox.textContent = error ? `Not applied: ${error} (the controls are back at recipe ${get("recipe_id")}, ` +
      "whose map is shown)" : "";
    root.dataset.error = error ? "true" : "false";
    const degenerate = get("degenerate");
    const cause = degenerateCause(degenerate, options.degenerate_causes);
    degenerateBox.hidden = !degenerate;
    degenerateBox.replaceChildren(...(degenerate ? [h("span", { className: "vc-cause", textContent: cause }),
      ` Degenerate variant (${cause}): the map is all zeros because ${degenerate}`] : []));
    root.dataset.degenerate = degenerate ? "true" : "false";
    root.dataset.degenerateCause = cause;
    const notes = get("notes");
    notesBox.hidden = !notes;
    notesBox.textContent = notes ? `Left out of the layer fusion (degenerate): ${notes}` : "";
    methods.textContent = get("methods");
    checklistSlot.replaceChildren(checklistTable(get("checklist")));
    status.textContent = error ? "refused" : "";
    root.dataset.state = error ? "error" : "ready";
  }

  function onAnswer() {
    const arrived = performance.now();
    const rid = model.get("response_id");
    if (rid < latest) {
      root.dataset.staleDropped = String(Number(root.dataset.staleDropped || 0) + 1);
      return; // a newer request is in flight: its answer will paint
    }
    const error = model.get("error");
    if (timer === null && !queued) { // no newer change waits to be sent: the controls show the map's recipe
      draft = JSON.parse(model.get("recipe_json"));
      controls.sync(draft);
    }
    showReport();
    if (error && painted !== model.get("recipe_id")) paint(); // a cached view of the refused draft is replaced
    if (picker) picker.value = String(model.get("image_index")); // a refused image: back to the one shown
    if (tracePick) tracePick.value = model.get("trace_shown"); // likewise a refused trace
    if (frameSlider) frameSlider.sync(); // and a refused frame
    if (!error) {
      remember(keyOf(JSON.parse(model.get("recipe_json"))), {
        recipe_json: model.get("recipe_json"), recipe_id: model.get("recipe_id"), grid: fromModel("grid"),
        grid_shape: model.get("grid_shape"), checklist: model.get("checklist"), methods: model.get("methods"),
        degenerate: model.get("degenerate"), notes: model.get("notes"), value_range: model.get("value_range"),
      });
      if (model.get("recipe_id") !== shownFromCache) paint(); // a cached view is already on the canvas
    }
    shownFromCache = null;
    if (started.has(rid)) {
      const [first, sent] = started.get(rid);
      root.dataset.lastPaintLatencyMs = (performance.now() - first).toFixed(2);
      root.dataset.lastWaitMs = (sent - first).toFixed(2);
      root.dataset.lastRoundTripMs = (arrived - sent).toFixed(2);
      root.dataset.lastPaintRequest = String(rid);
      for (const key of [...started.keys()]) if (key <= rid) started.delete(key);
    }
    if (timer !== null) {
      root.dataset.state = "pending";
      status.textContent = "computing…";
    }
  }

  const onImage = () => {
    cache.clear(); // another image of a store: every cached map belongs to the previous one
    image = imageCanvas(model.get("image"), model.get("image_shape"));
    paint();
  };
  const onDisplay = () => {
    display.sync();
    paint();
  };
  const onOptions = () => {
    // Another image of a store traced other classes, or another trace other sites: the controls are rebuilt.
    controlsNode.replaceChildren();
    controls = recipeControls(controlsNode, model.get("options").fields, onControl);
    controls.sync(draft);
    if (presetMenu) fillPresets(presetMenu);
  };
  const onImageIndex = () => {
    if (picker) picker.value = String(model.get("image_index"));
  };
  const onTrace = () => {
    cache.clear(); // the maps cached so far are the other trace's
    root.dataset.trace = model.get("trace_shown");
    if (tracePick) tracePick.value = model.get("trace_shown");
  };
  const onFrame = () => {
    cache.clear(); // the maps cached so far are another frame's
    if (frameSlider) frameSlider.sync();
  };
  const unlisten = listen(model, {
    "change:frame": onAnswer, "change:frame_shown": onFrame, "msg:custom": onCustom, "change:image": onImage,
    "change:opacity": onDisplay, "change:colormap": onDisplay, "change:size": paint, "change:options": onOptions,
    "change:image_index": onImageIndex, "change:trace_shown": onTrace,
  });
  controls.sync(draft);
  showReport();
  paint();
  root.dataset.ready = "true";
  if (typeof model.send === "function") model.send({ kind: "prefetch" }); // the exported page has no kernel
  return () => {
    clearTimeout(timer);
    unlisten();
  };
}

export default { render };
