// vitcam_nb exported Explorer (one HTML file, no kernel, no network). Python writes this file after core.js
// and explorer.js into one inline module, with the data in three inline elements (vitcam_nb/widgets/bundle.py):
//   #vc-meta  JSON: axes [[field, values]], controls, shapes, how maps are stored, the entry shown first
//   #vc-maps  base64 of zlib(image RGBA, [low, high] float32 per map when uint8, the quantised grids)
//   #vc-texts base64 of zlib(JSON list, one entry per combination of the axes, first axis slowest):
//             {g: map index, r: recipe JSON, id, c: checklist, md, m: methods, d: degenerate, n: notes} or {e}
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

/** A stand-in for the widget model: get/set/save_changes/on/off, answering requests from the table. */
function localModel(meta, maps, entries) {
  const listeners = new Map();
  const keys = meta.axes.map(([, values]) => new Map(values.map((v, i) => [JSON.stringify(v), i])));
  const state = {
    options: meta.options, image: maps.subarray(0, meta.image_bytes), image_shape: meta.image_shape,
    size: meta.size, opacity: meta.opacity, colormap: meta.colormap, images: [], image_index: 0,
    response_id: 0, frame: 0, error: "", request: {}, image_request: {},
  };
  const shown = (entry) => ({
    recipe_json: entry.r, recipe_id: entry.id, grid: gridBytes(meta, maps, entry.g), grid_shape: meta.grid_shape,
    checklist: entry.c, checklist_md: entry.md, methods: entry.m, degenerate: entry.d, notes: entry.n, error: "",
  });
  Object.assign(state, shown(entries[meta.start]));

  function update(changes) {
    const changed = Object.keys(changes).filter((k) => state[k] !== changes[k]);
    Object.assign(state, changes);
    for (const key of changed) for (const fn of listeners.get(`change:${key}`) || []) fn();
  }

  // The index of a draft in the table (the axes in order, first slowest), or a message why it is not there.
  function lookup(draft) {
    let index = 0;
    for (let a = 0; a < meta.axes.length; a++) {
      const [field, values] = meta.axes[a];
      let value = draft[field];
      if (field === "layer" && Number.isInteger(value)) value = ((value % meta.num_layers) + meta.num_layers) % meta.num_layers;
      const pos = keys[a].get(JSON.stringify(value));
      if (pos === undefined) {
        return `${field} = ${JSON.stringify(value)} is not in this file (it holds ${values.map((v) => JSON.stringify(v)).join(", ")})`;
      }
      index = index * values.length + pos;
    }
    return index;
  }

  // A field the file does not vary holds one value in every entry: a draft (e.g. a preset) that asks for another
  // value of a field that applies is not in the file, rather than shown as the entry's own recipe.
  const varied = new Set(meta.axes.map(([field]) => field));
  const layerOf = (v) => (Number.isInteger(v) ? ((v % meta.num_layers) + meta.num_layers) % meta.num_layers : v);
  function fixedFieldMiss(draft, entry) {
    if (entry.r === undefined) return null;
    const stored = JSON.parse(entry.r);
    for (const field of meta.options.fields) {
      const name = field.name;
      if (varied.has(name) || !(name in draft) || !applies(field.when, draft)) continue;
      const norm = name === "layer" ? layerOf : (v) => v;
      if (JSON.stringify(norm(draft[name])) !== JSON.stringify(norm(stored[name]))) {
        const [want, have] = [JSON.stringify(draft[name]), JSON.stringify(stored[name])];
        return `${name} = ${want} is not in this file (it holds ${have} only)`;
      }
    }
    return null;
  }

  function answer(request) {
    const id = Math.max(Number(request.id) || 0, state.response_id);
    const draft = request.recipe || {};
    const index = lookup(draft);
    let entry = typeof index === "number" ? entries[index] : { e: index };
    const miss = fixedFieldMiss(draft, entry);
    if (miss) entry = { e: miss };
    if (entry.e !== undefined) update({ error: entry.e, response_id: id, frame: state.frame + 1 });
    else update({ ...shown(entry), response_id: id, frame: state.frame + 1 });
  }

  return {
    get: (name) => state[name],
    set: (name, value) => {
      if (name === "request" || name === "image_request") state[name] = value;
      else update({ [name]: value });
    },
    save_changes: () => {
      const request = state.request;
      state.request = {};
      if (request && request.id !== undefined) answer(request);
    },
    on: (event, fn) => listeners.set(event, [...(listeners.get(event) || []), fn]),
    off: (event, fn) => listeners.set(event, (listeners.get(event) || []).filter((f) => f !== fn)),
    lookup,
  };
}

async function mountExported() {
  const host = document.getElementById("vc-app");
  try {
    if (typeof DecompressionStream === "undefined") throw new Error("this browser has no DecompressionStream");
    const meta = JSON.parse(document.getElementById("vc-meta").textContent);
    const maps = await inflate(document.getElementById("vc-maps").textContent.trim());
    const texts = await inflate(document.getElementById("vc-texts").textContent.trim());
    const entries = JSON.parse(new TextDecoder().decode(texts));
    const model = localModel(meta, maps, entries);
    window.vitcamExplorer = model;
    render({ model, el: host });
    document.body.dataset.loaded = "true";
  } catch (err) {
    host.append(h("p", { className: "vc-error", textContent: `The explorer could not start: ${err.message}` }));
    document.body.dataset.loaded = "error";
  }
}

mountExported();
