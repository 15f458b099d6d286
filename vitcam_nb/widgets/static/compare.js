// vitcam_nb Compare view (vitcam_nb/widgets/compare.py): two grids side by side, their agreement
// (Spearman, top-k IoU; k is changed here and recomputed in the kernel) and the recipe fields table
// with the differing fields highlighted.

function render({ model, el }) {
  const root = h("div", { className: "vc-widget vc-compare", dataset: { paintCount: "0" }, attrs: SUPPRESS_SHORTCUTS });
  el.append(root);
  let image = imageCanvas(model.get("image"), model.get("image_shape"));

  const panel = (name) => {
    const id = h("code", { className: "vc-recipe-id" });
    const canvas = h("canvas", { className: "vc-canvas" });
    const bar = h("div", { className: "vc-colorbar-slot" });
    const degenerate = h("div", { className: "vc-degenerate", hidden: true, attrs: { role: "status" } });
    const node = h("div", { className: "vc-view", dataset: { side: name } },
      h("div", { className: "vc-header" }, h("strong", { textContent: name }), id), canvas, bar, degenerate);
    return { id, canvas, bar, degenerate, node };
  };
  const a = panel("A");
  const b = panel("B");
  const display = displayControls(model, ["inferno", "viridis", "gray", "jet"], () => paint());
  const rho = h("strong", { className: "vc-spearman" });
  const iou = h("strong", { className: "vc-topk" });
  const kLabel = h("span");
  const kInput = h("input", { type: "range", min: 0.01, max: 1, step: 0.01, className: "vc-k", title: "top-k fraction" });
  kInput.dataset.field = "k";
  let kTimer = null;
  kInput.addEventListener("input", () => {
    kLabel.textContent = `top-${Math.round(Number(kInput.value) * 100)}%`;
    clearTimeout(kTimer);
    kTimer = setTimeout(() => {
      model.set("k", Number(kInput.value));
      model.save_changes();
    }, 30);
  });
  const notes = h("div", { className: "vc-notes", hidden: true });
  const errorBox = h("div", { className: "vc-error", hidden: true, attrs: { role: "alert" } });
  const agreement = h("div", { className: "vc-agreement" },
    h("span", { className: "vc-stat" }, "Spearman ρ ", rho),
    h("span", { className: "vc-stat" }, kLabel, " IoU ", iou),
    h("label", {}, "k ", kInput));
  const table = h("table", { className: "vc-fields" });
  root.append(
    h("div", { className: "vc-header" }, h("strong", { textContent: "vitcam_nb Compare" }),
      h("span", { className: "vc-status", textContent: " agreement measured on the token grid" })),
    errorBox, agreement, notes, display.node,
    h("div", { className: "vc-compare-panels" }, a.node, b.node), table);

  function paint() {
    const [gh, gw] = model.get("grid_shape");
    const [ih, iw] = model.get("image_shape");
    const size = model.get("size");
    const scale = Math.max(1, Math.ceil(size / Math.max(iw, 1)));
    for (const [side, key, recipeKey] of [[a, "grid_a", "recipe_a_json"], [b, "grid_b", "recipe_b_json"]]) {
      const recipe = JSON.parse(model.get(recipeKey) || "{}");
      const [lo, hi] = paintOverlay(side.canvas, image, floatsOf(model.get(key)), gh, gw, {
        width: iw * scale, height: ih * scale, mode: recipe.upsample, normalize: recipe.normalize,
        cmap: model.get("colormap"), opacity: model.get("opacity"),
      });
      side.canvas.style.width = `${size}px`;
      side.bar.replaceChildren(colorbar(model.get("colormap"), lo, hi));
    }
    root.dataset.paintCount = String(Number(root.dataset.paintCount) + 1);
  }

  function showStats() {
    a.id.textContent = model.get("id_a");
    b.id.textContent = model.get("id_b");
    for (const [side, key] of [[a, "a"], [b, "b"]]) {
      const why = model.get(`degenerate_${key}`);
      const cause = model.get(`cause_${key}`) || "other";
      side.degenerate.hidden = !why;
      side.degenerate.replaceChildren(...(why ? [h("span", { className: "vc-cause", textContent: cause }),
        ` Degenerate variant (${cause}): the map is all zeros because ${why}`] : []));
    }
    const s = model.get("spearman");
    const t = model.get("topk_iou");
    rho.textContent = s === null ? "n/a" : s.toFixed(3);
    iou.textContent = t === null ? "n/a" : `${t.toFixed(3)} (${model.get("k_cells")} cells)`;
    root.dataset.spearman = s === null ? "" : String(s);
    root.dataset.topkIou = t === null ? "" : String(t);
    kInput.value = String(model.get("k"));
    kLabel.textContent = `top-${Math.round(model.get("k") * 100)}%`;
    notes.hidden = !model.get("notes");
    notes.textContent = model.get("notes");
    errorBox.hidden = !model.get("error");
    errorBox.textContent = model.get("error");
    table.replaceChildren(h("tr", {}, h("th", { textContent: "field" }), h("th", { textContent: "A" }),
      h("th", { textContent: "B" }), h("th", { textContent: "" })));
    for (const f of model.get("fields")) {
      table.append(h("tr", { className: f.differs ? "vc-diff" : "", dataset: { field: f.name } },
        h("td", { textContent: f.name }), h("td", { textContent: f.a }), h("td", { textContent: f.b }),
        h("td", { textContent: f.differs ? "differs" : "" })));
    }
  }

  const onFrame = () => {
    showStats();
    paint();
  };
  const onDisplay = () => {
    display.sync();
    paint();
  };
  const onImage = () => {
    image = imageCanvas(model.get("image"), model.get("image_shape"));
    paint();
  };
  const unlisten = listen(model, {
    "change:frame": onFrame, "change:error": showStats, "change:opacity": onDisplay, "change:colormap": onDisplay,
    "change:image": onImage, "change:size": paint,
  });
  onFrame();
  root.dataset.ready = "true";
  return () => {
    clearTimeout(kTimer);
    unlisten();
  };
}

export default { render };
