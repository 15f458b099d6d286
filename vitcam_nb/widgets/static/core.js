// vitcam_nb widgets: shared browser code (plain ES module text, no build step, no network).
// Python prepends this file to each widget's own module, so everything here is module-private.
//
// Security: every string that comes from the kernel (class labels, messages, recipe values) is put in
// the page with textContent or as a property, never parsed as HTML.

const LUT_HEX = {
  jet:
    "00008000008400008900008d00009200009600009b00009f0000a40000a80000ad0000b20000b60000bb0000bf0000c40000c80000cd" +
    "0000d10000d60000da0000df0000e30000e80000ed0000f10000f60000fa0000ff0000ff0000ff0000ff0000ff0004ff0008ff000cff" +
    "0010ff0014ff0018ff001cff0020ff0024ff0028ff002cff0030ff0034ff0038ff003cff0040ff0044ff0048ff004cff0050ff0054ff" +
    "0058ff005cff0060ff0064ff0068ff006cff0070ff0074ff0078ff007cff0080ff0084ff0088ff008cff0090ff0094ff0098ff009cff" +
    "00a0ff00a4ff00a8ff00acff00b0ff00b4ff00b8ff00bcff00c0ff00c4ff00c8ff00ccff00d0ff00d4ff00d8ff00dcfe00e0fb00e4f8" +
    "02e8f406ecf109f0ee0cf4eb0ff8e713fce416ffe119ffde1cffdb1fffd723ffd426ffd129ffce2cffca30ffc733ffc436ffc139ffbe" +
    "3cffba40ffb743ffb446ffb149ffad4dffaa50ffa753ffa456ffa05aff9d5dff9a60ff9763ff9466ff906aff8d6dff8a70ff8773ff83" +
    "77ff807aff7d7dff7a80ff7783ff7387ff708aff6d8dff6a90ff6694ff6397ff609aff5d9dff5aa0ff56a4ff53a7ff50aaff4dadff49" +
    "b1ff46b4ff43b7ff40baff3cbeff39c1ff36c4ff33c7ff30caff2cceff29d1ff26d4ff23d7ff1fdbff1cdeff19e1ff16e4ff13e7ff0f" +
    "ebff0ceeff09f1fc06f4f802f8f500fbf100feed00ffea00ffe600ffe200ffde00ffdb00ffd700ffd300ffd000ffcc00ffc800ffc400" +
    "ffc100ffbd00ffb900ffb600ffb200ffae00ffab00ffa700ffa300ff9f00ff9c00ff9800ff9400ff9100ff8d00ff8900ff8600ff8200" +
    "ff7e00ff7a00ff7700ff7300ff6f00ff6c00ff6800ff6400ff6000ff5d00ff5900ff5500ff5200ff4e00ff4a00ff4700ff4300ff3f00" +
    "ff3b00ff3800ff3400ff3000ff2d00ff2900ff2500ff2200ff1e00ff1a00ff1600ff1300fa0f00f60b00f10800ed0400e80000e40000" +
    "df0000da0000d60000d10000cd0000c80000c40000bf0000bb0000b60000b20000ad0000a80000a400009f00009b0000960000920000" +
    "8d0000890000840000800000",
  viridis:
    "44015444025645045745055946075a46085c460a5d460b5e470d60470e6147106347116447136548146748166848176948186a481a6c" +
    "481b6d481c6e481d6f481f70482071482173482374482475482576482677482878482979472a7a472c7a472d7b472e7c472f7d46307e" +
    "46327e46337f463480453581453781453882443983443a83443b84433d84433e85423f85424086424186414287414487404588404688" +
    "3f47883f48893e49893e4a893e4c8a3d4d8a3d4e8a3c4f8a3c508b3b518b3b528b3a538b3a548c39558c39568c38588c38598c375a8c" +
    "375b8d365c8d365d8d355e8d355f8d34608d34618d33628d33638d32648e32658e31668e31678e31688e30698e306a8e2f6b8e2f6c8e" +
    "2e6d8e2e6e8e2e6f8e2d708e2d718e2c718e2c728e2c738e2b748e2b758e2a768e2a778e2a788e29798e297a8e297b8e287c8e287d8e" +
    "277e8e277f8e27808e26818e26828e26828e25838e25848e25858e24868e24878e23888e23898e238a8d228b8d228c8d228d8d218e8d" +
    "218f8d21908d21918c20928c20928c20938c1f948c1f958b1f968b1f978b1f988b1f998a1f9a8a1e9b8a1e9c891e9d891f9e891f9f88" +
    "1fa0881fa1881fa1871fa28720a38620a48621a58521a68522a78522a88423a98324aa8325ab8225ac8226ad8127ad8128ae8029af7f" +
    "2ab07f2cb17e2db27d2eb37c2fb47c31b57b32b67a34b67935b77937b87838b9773aba763bbb753dbc743fbc7340bd7242be7144bf70" +
    "46c06f48c16e4ac16d4cc26c4ec36b50c46a52c56954c56856c66758c7655ac8645cc8635ec96260ca6063cb5f65cb5e67cc5c69cd5b" +
    "6ccd5a6ece5870cf5773d05675d05477d1537ad1517cd2507fd34e81d34d84d44b86d54989d5488bd6468ed64590d74393d74195d840" +
    "98d83e9bd93c9dd93ba0da39a2da37a5db36a8db34aadc32addc30b0dd2fb2dd2db5de2bb8de29bade28bddf26c0df25c2df23c5e021" +
    "c8e020cae11fcde11dd0e11cd2e21bd5e21ad8e219dae319dde318dfe318e2e418e5e419e7e419eae51aece51befe51cf1e51df4e61e" +
    "f6e620f8e621fbe723fde725",
  inferno:
    "00000401000501010601010802010a02020c02020e03021004031204031405041706041907051b08051d09061f0a07220b07240c0826" +
    "0d08290e092b10092d110a30120a32140b34150b37160b39180c3c190c3e1b0c411c0c431e0c451f0c48210c4a230c4c240c4f260c51" +
    "280b53290b552b0b572d0b592f0a5b310a5c320a5e340a5f3609613809623909633b09643d09653e0966400a67420a68440a68450a69" +
    "470b6a490b6a4a0c6b4c0c6b4d0d6c4f0d6c510e6c520e6d540f6d550f6d57106e59106e5a116e5c126e5d126e5f136e61136e62146e" +
    "64156e65156e67166e69166e6a176e6c186e6d186e6f196e71196e721a6e741a6e751b6e771c6d781c6d7a1d6d7c1d6d7d1e6d7f1e6c" +
    "801f6c82206c84206b85216b87216b88226a8a226a8c23698d23698f24699025689225689326679526679727669827669a28659b2964" +
    "9d29649f2a63a02a63a22b62a32c61a52c60a62d60a82e5fa92e5eab2f5ead305dae305cb0315bb1325ab3325ab43359b63458b73557" +
    "b93556ba3655bc3754bd3853bf3952c03a51c13a50c33b4fc43c4ec63d4dc73e4cc83f4bca404acb4149cc4248ce4347cf4446d04545" +
    "d24644d34743d44842d54a41d74b3fd84c3ed94d3dda4e3cdb503bdd513ade5238df5337e05536e15635e25734e35933e45a31e55c30" +
    "e65d2fe75e2ee8602de9612bea632aeb6429eb6628ec6726ed6925ee6a24ef6c23ef6e21f06f20f1711ff1731df2741cf3761bf37819" +
    "f47918f57b17f57d15f67e14f68013f78212f78410f8850ff8870ef8890cf98b0bf98c0af98e09fa9008fa9207fa9407fb9606fb9706" +
    "fb9906fb9b06fb9d07fc9f07fca108fca309fca50afca60cfca80dfcaa0ffcac11fcae12fcb014fcb216fcb418fbb61afbb81dfbba1f" +
    "fbbc21fbbe23fac026fac228fac42afac62df9c72ff9c932f9cb35f8cd37f8cf3af7d13df7d340f6d543f6d746f5d949f5db4cf4dd4f" +
    "f4df53f4e156f3e35af3e55df2e661f2e865f2ea69f1ec6df1ed71f1ef75f1f179f2f27df2f482f3f586f3f68af4f88ef5f992f6fa96" +
    "f8fb9af9fc9dfafda1fcffa4",
};
const LUT_CACHE = {};

// Keys pressed in a widget's controls (arrows on a slider, Enter on a button) belong to the control, not
// to JupyterLab / Notebook 7 shortcuts. Lumino stops matching shortcuts at an element with this
// attribute; command-mode bindings such as `.jp-Notebook.jp-mod-commandMode :focus:not(:read-write)`
// match the focused control itself, so every control carries it (see h()), and so does the root.
const SUPPRESS_SHORTCUTS = { "data-lm-suppress-shortcuts": "true" };
const CONTROL_TAGS = new Set(["input", "select", "button", "textarea"]);

/** 256x3 uint8 colour table of a colormap (matplotlib's, resampled to 256 entries). */
function colormapLut(name) {
  if (LUT_CACHE[name]) return LUT_CACHE[name];
  const lut = new Uint8Array(768);
  if (name === "gray" || !(name in LUT_HEX)) {
    for (let i = 0; i < 256; i++) lut[3 * i] = lut[3 * i + 1] = lut[3 * i + 2] = i;
  } else {
    const hex = LUT_HEX[name];
    for (let i = 0; i < 768; i++) lut[i] = parseInt(hex.substr(2 * i, 2), 16);
  }
  LUT_CACHE[name] = lut;
  return lut;
}

/** Subscribe `handlers` ({event: fn}) to the model; returns the function that unsubscribes them all.
 * A change handler runs once the whole update it came in is applied: JupyterLab sets every key of a kernel
 * message before it emits any change, but marimo's model sets them one at a time and emits `change:key` after
 * each, so a handler of "frame" would read the previous "grid" of the same answer. Each handler is deferred to a
 * microtask (still before the next frame is drawn); events keep their order. Custom messages run at once. */
function listen(model, handlers) {
  const wrapped = Object.entries(handlers).map(([event, fn]) =>
    [event, event.startsWith("change:") ? (...args) => queueMicrotask(() => fn(...args)) : fn]);
  for (const [event, fn] of wrapped) model.on(event, fn);
  return () => {
    for (const [event, fn] of wrapped) model.off(event, fn);
  };
}

/** A Uint8Array view of a binary trait value (DataView, ArrayBuffer or typed array). */
function bytesOf(value) {
  if (!value) return new Uint8Array(0);
  if (value instanceof ArrayBuffer) return new Uint8Array(value);
  if (ArrayBuffer.isView(value)) return new Uint8Array(value.buffer, value.byteOffset, value.byteLength);
  return new Uint8Array(0);
}

/** float32 little-endian bytes -> Float32Array (copies, so alignment never matters). */
function floatsOf(value, offset = 0, count = -1) {
  const bytes = bytesOf(value);
  const n = count >= 0 ? count : Math.floor(bytes.byteLength / 4) - offset;
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const out = new Float32Array(n);
  for (let i = 0; i < n; i++) out[i] = view.getFloat32(4 * (offset + i), true);
  return out;
}

// 1-D interpolation taps of torch.nn.functional.interpolate (half-pixel centres, align_corners=False), as
// flat arrays with k taps per output index; cached, since a widget repaints at the same sizes.
const TAP_CACHE = new Map();

function taps(nIn, nOut, mode) {
  const key = `${nIn}/${nOut}/${mode}`;
  if (TAP_CACHE.has(key)) return TAP_CACHE.get(key);
  const k = mode === "bicubic" ? 4 : mode === "nearest" || mode === "none" ? 1 : 2;
  const idx = new Int32Array(nOut * k);
  const w = new Float64Array(nOut * k);
  const scale = nIn / nOut;
  const clampIndex = (i) => Math.min(Math.max(i, 0), nIn - 1);
  const A = -0.75;
  const far = (x) => ((A * x - 5 * A) * x + 8 * A) * x - 4 * A;
  const near = (x) => ((A + 2) * x - (A + 3)) * x * x + 1;
  for (let o = 0; o < nOut; o++) {
    const at = o * k;
    if (k === 1) {
      idx[at] = Math.min(Math.floor(o * scale), nIn - 1);
      w[at] = 1;
    } else if (k === 4) {
      const src = scale * (o + 0.5) - 0.5;
      const i = Math.floor(src);
      const t = src - i;
      const weights = [far(t + 1), near(t), near(1 - t), far(2 - t)];
      for (let j = 0; j < 4; j++) {
        idx[at + j] = clampIndex(i - 1 + j);
        w[at + j] = weights[j];
      }
    } else {
      const src = Math.max(scale * (o + 0.5) - 0.5, 0);
      const i0 = Math.floor(src);
      const l1 = src - i0;
      idx[at] = i0;
      idx[at + 1] = i0 < nIn - 1 ? i0 + 1 : i0;
      w[at] = 1 - l1;
      w[at + 1] = l1;
    }
  }
  const out = { k, idx, w };
  if (TAP_CACHE.size > 64) TAP_CACHE.clear();
  TAP_CACHE.set(key, out);
  return out;
}

/** Upsample a (gh, gw) grid to (H, W) with the recipe's rule ("none" shows the token cells). */
function upsample(grid, gh, gw, H, W, mode) {
  const tx = taps(gw, W, mode);
  const ty = taps(gh, H, mode);
  const rows = new Float64Array(gh * W);
  for (let r = 0; r < gh; r++) {
    const base = r * gw;
    for (let x = 0; x < W; x++) {
      let s = 0;
      for (let t = x * tx.k, end = t + tx.k; t < end; t++) s += tx.w[t] * grid[base + tx.idx[t]];
      rows[r * W + x] = s;
    }
  }
  const out = new Float32Array(H * W);
  for (let y = 0; y < H; y++) {
    const o = y * W;
    for (let t = y * ty.k, end = t + ty.k; t < end; t++) {
      const wt = ty.w[t];
      const src = ty.idx[t] * W;
      for (let x = 0; x < W; x++) out[o + x] += wt * rows[src + x];
    }
  }
  return out;
}

/** The value range mapped onto the colormap, as vc.cam normalises after upsampling. */
function displayRange(values, normalize) {
  let lo = Infinity;
  let hi = -Infinity;
  for (let i = 0; i < values.length; i++) {
    const v = values[i];
    if (v < lo) lo = v;
    if (v > hi) hi = v;
  }
  if (!Number.isFinite(lo)) return [0, 1];
  if (normalize === "max") return [0, hi > 0 ? hi : 1];
  return hi > lo ? [lo, hi] : [lo, lo + 1];
}

/** An offscreen canvas holding the trace image (RGBA bytes received once). */
function imageCanvas(value, shape) {
  const [h, w] = shape || [0, 0];
  const canvas = document.createElement("canvas");
  canvas.width = Math.max(w, 1);
  canvas.height = Math.max(h, 1);
  const bytes = bytesOf(value);
  if (h > 0 && w > 0 && bytes.byteLength === h * w * 4) {
    const data = new ImageData(new Uint8ClampedArray(bytes), w, h);
    canvas.getContext("2d").putImageData(data, 0, 0);
  }
  return canvas;
}

/**
 * Paint image + coloured map on `canvas` (its size is set here). `grid` is (gh, gw) float32. `range`: the
 * [low, high] the colours span when it is not the drawn values' own (a video frame: the whole clip's).
 * Returns the value range the colours span (for the colour bar).
 */
function paintOverlay(canvas, image, grid, gh, gw, opts) {
  const { width, height, mode = "bilinear", normalize = "minmax", cmap = "inferno", opacity = 0.5, range } = opts;
  if (canvas.width !== width) canvas.width = width;
  if (canvas.height !== height) canvas.height = height;
  const ctx = canvas.getContext("2d");
  ctx.imageSmoothingEnabled = width < image.width; // crisp pixels when enlarging, smooth when shrinking
  ctx.clearRect(0, 0, width, height);
  ctx.drawImage(image, 0, 0, width, height);
  if (!grid || grid.length !== gh * gw || gh === 0) return [0, 1];
  const values = upsample(grid, gh, gw, height, width, mode);
  const [lo, hi] = range && range.length === 2 ? range : displayRange(values, normalize);
  const lut = colormapLut(cmap);
  const heat = new ImageData(width, height);
  const alpha = Math.round(255 * Math.min(Math.max(opacity, 0), 1));
  const k = 255 / (hi - lo);
  for (let i = 0; i < values.length; i++) {
    const c = 3 * Math.min(255, Math.max(0, Math.round((values[i] - lo) * k)));
    heat.data[4 * i] = lut[c];
    heat.data[4 * i + 1] = lut[c + 1];
    heat.data[4 * i + 2] = lut[c + 2];
    heat.data[4 * i + 3] = alpha;
  }
  const layer = document.createElement("canvas");
  layer.width = width;
  layer.height = height;
  layer.getContext("2d").putImageData(heat, 0, 0);
  ctx.drawImage(layer, 0, 0);
  // vc.cam normalises again after upsampling, so a normalised map's colours span exactly [0, 1].
  return normalize === "none" ? [lo, hi] : [0, 1];
}

/** A horizontal colour bar with its range. */
function colorbar(cmap, lo, hi) {
  const wrap = h("div", { className: "vc-colorbar" });
  const bar = document.createElement("canvas");
  bar.width = 256;
  bar.height = 1;
  const img = new ImageData(256, 1);
  const lut = colormapLut(cmap);
  for (let i = 0; i < 256; i++) {
    img.data.set([lut[3 * i], lut[3 * i + 1], lut[3 * i + 2], 255], 4 * i);
  }
  bar.getContext("2d").putImageData(img, 0, 0);
  wrap.append(h("span", { textContent: fmt(lo) }), bar, h("span", { textContent: fmt(hi) }));
  return wrap;
}

function fmt(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "n/a";
  const a = Math.abs(v);
  return a !== 0 && (a < 1e-3 || a >= 1e4) ? v.toExponential(2) : String(Math.round(v * 1000) / 1000);
}

/** Create an element; props are set as properties (textContent, className, ...), never as HTML. */
function h(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  if (CONTROL_TAGS.has(tag)) node.setAttribute("data-lm-suppress-shortcuts", "true");
  for (const [key, value] of Object.entries(props)) {
    if (key === "dataset") Object.assign(node.dataset, value);
    else if (key === "attrs") for (const [a, v] of Object.entries(value)) node.setAttribute(a, String(v));
    else node[key] = value;
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

/** Copy text to the clipboard; the button says whether it worked. */
function copyButton(label, getText) {
  const button = h("button", { type: "button", className: "vc-copy", textContent: label });
  button.addEventListener("click", async () => {
    const text = getText();
    let ok = false;
    try {
      await navigator.clipboard.writeText(text);
      ok = true;
    } catch (_err) {
      const area = h("textarea", { value: text, className: "vc-offscreen" });
      document.body.append(area);
      area.select();
      try {
        ok = document.execCommand("copy");
      } catch (_e) {
        ok = false;
      }
      area.remove();
    }
    button.textContent = ok ? "copied" : "copy failed (select the text)";
    setTimeout(() => (button.textContent = label), 1500);
  });
  return button;
}

/** Whether a control applies to a draft recipe: all conditions of `when` hold. */
function applies(when, draft) {
  for (const rule of when || []) {
    const value = draft[rule.field];
    if (rule.in && !rule.in.includes(value)) return false;
    if (rule.not_in && rule.not_in.includes(value)) return false;
  }
  return true;
}

/**
 * Render one control per recipe field from the `options.fields` table (so this code knows no taxonomy).
 * `onChange(field, value, discrete)` is called on user input (`discrete`: a select, not a slider being
 * dragged). Returns { sync(draft) } to show a recipe.
 */
function recipeControls(container, fields, onChange) {
  const rows = {};
  const groups = {};
  for (const field of fields) {
    if (!groups[field.group]) {
      groups[field.group] = h("fieldset", { className: "vc-group" }, h("legend", { textContent: field.group }));
      container.append(groups[field.group]);
    }
    const id = `vc-${Math.random().toString(36).slice(2)}`;
    const label = h("label", { textContent: field.label, htmlFor: id });
    let control;
    let readout = null;
    if (field.kind === "layer") {
      control = h("input", { type: "range", id, min: 0, max: Math.max(field.layers.length - 1, 0), step: 1 });
      readout = h("output", { className: "vc-readout" });
      control.addEventListener("input", () => {
        const spec = rows[field.name].spec || field;
        const layer = spec.layers[Number(control.value)];
        readout.textContent = layerText(layer, spec);
        onChange(field.name, layer);
      });
    } else {
      control = h("select", { id });
      for (const [value, text] of field.values) {
        control.append(h("option", { value: JSON.stringify(value), textContent: text }));
      }
      control.disabled = field.values.length < 2;
      control.addEventListener("change", () => onChange(field.name, JSON.parse(control.value), true));
    }
    control.dataset.field = field.name;
    const row = h("div", { className: "vc-row", dataset: { field: field.name } }, label, control, readout);
    groups[field.group].append(row);
    rows[field.name] = { field, row, control, readout };
  }
  function sync(draft) {
    syncRows(draft);
    for (const group of Object.values(groups)) {
      group.hidden = [...group.querySelectorAll(".vc-row")].every((row) => row.hidden);
    }
  }
  function syncRows(draft) {
    for (const { field, row, control, readout } of Object.values(rows)) {
      const ok = applies(field.when, draft);
      row.hidden = !ok;
      row.dataset.applies = String(ok);
      const value = draft[field.name];
      if (field.kind === "layer") {
        // a VLM's projector and LM sites have layers of their own (`by_site`): the slider follows the site
        const spec = layerSpec(field, draft);
        rows[field.name].spec = spec;
        control.max = String(Math.max(spec.layers.length - 1, 0));
        const single = Number.isInteger(value);
        control.disabled = !single || spec.layers.length < 2;
        if (single) {
          const n = spec.num_layers;
          const idx = spec.layers.indexOf(((value % n) + n) % n);
          if (idx >= 0) control.value = String(idx);
        }
        readout.textContent = layerText(value, spec);
      } else {
        const text = JSON.stringify(value);
        if (![...control.options].some((o) => o.value === text)) {
          control.append(h("option", { value: text, textContent: String(value) }));
        }
        control.value = text;
      }
    }
  }
  return { sync, rows };
}

/** The layers the layer slider offers for the draft's site: the site's own (`by_site`) or the tower's. */
function layerSpec(field, draft) {
  return (field.by_site && field.by_site[draft.site]) || field;
}

function layerText(value, field) {
  if (Number.isInteger(value)) {
    const n = field.num_layers;
    const abs = ((value % n) + n) % n;
    return abs === n - 1 ? `${abs} (last)` : String(abs);
  }
  if (value === "all") return "all traced layers";
  if (Array.isArray(value)) return `layers ${value.join(", ")}`;
  return String(value);
}

/**
 * The short cause of a degenerate map from its reason, as vitcam_nb.compute.maps.degenerate_cause gives it:
 * `table` is its DEGENERATE_CAUSES ([phrase, label] pairs, sent by the kernel); phrases are found left to right,
 * each distinct label once, joined by " + "; "other" when none is found, "" for no reason.
 */
function degenerateCause(reason, table) {
  if (!reason) return "";
  const escape = (s) => s.replace(/[.*+?^${}()|[\]\\]/g, "\\$&");
  const pattern = new RegExp((table || []).map(([phrase]) => `(${escape(phrase)})`).join("|") || "(?!)", "g");
  const causes = [];
  for (const match of reason.matchAll(pattern)) {
    const label = table[match.slice(1).findIndex((g) => g !== undefined)][1];
    if (!causes.includes(label)) causes.push(label);
  }
  return causes.length ? causes.join(" + ") : "other";
}

/** The checklist (category -> item -> text) as a table. */
function checklistTable(checklist) {
  const table = h("table", { className: "vc-checklist" });
  for (const [category, items] of Object.entries(checklist || {})) {
    let first = true;
    for (const [item, value] of Object.entries(items)) {
      table.append(h("tr", {},
        h("th", { textContent: first ? category : "", scope: "row" }),
        h("td", { textContent: item }),
        h("td", { textContent: String(value) })));
      first = false;
    }
  }
  return table;
}

/** Colormap and opacity controls bound to the model's `colormap` and `opacity` traits. */
function displayControls(model, colormaps, onChange) {
  const cmap = h("select", { className: "vc-cmap", title: "colormap" });
  for (const name of colormaps) cmap.append(h("option", { value: name, textContent: name }));
  const opacity = h("input", { type: "range", min: 0, max: 1, step: 0.05, className: "vc-opacity", title: "opacity" });
  cmap.dataset.field = "colormap";
  opacity.dataset.field = "opacity";
  const sync = () => {
    cmap.value = model.get("colormap");
    opacity.value = String(model.get("opacity"));
  };
  cmap.addEventListener("change", () => {
    model.set("colormap", cmap.value);
    model.save_changes();
    onChange();
  });
  opacity.addEventListener("input", () => {
    model.set("opacity", Number(opacity.value));
    model.save_changes();
    onChange();
  });
  sync();
  const node = h("div", { className: "vc-display" },
    h("label", {}, "colormap ", cmap), h("label", {}, "opacity ", opacity));
  return { node, sync };
}
