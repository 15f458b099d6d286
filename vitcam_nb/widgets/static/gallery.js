// vitcam_nb Gallery thumbnails (vitcam_nb/widgets/gallery.py). All maps arrive as one float32 buffer
// of shape (rows, cols, gh, gw); a click sends `selected` = {cell: [row, col], n} and the kernel opens
// that recipe in an Explorer below the grid.

function render({ model, el }) {
  const root = h("div", { className: "vc-widget vc-gallery", dataset: { paintCount: "0" }, attrs: SUPPRESS_SHORTCUTS });
  el.append(root);
  let clicks = 0;
  let image = imageCanvas(model.get("image"), model.get("image_shape"));
  const cells = [];

  const errorBox = h("div", { className: "vc-error", hidden: true, attrs: { role: "alert" } });
  const gridNode = h("div", { className: "vc-gallery-grid" });
  const display = displayControls(model, ["inferno", "viridis", "gray", "jet"], () => paintAll());
  const header = h("div", { className: "vc-header" },
    h("strong", { textContent: "vitcam_nb Gallery" }),
    h("span", { textContent: " base recipe " }), h("code", { textContent: model.get("base_id") }),
    h("span", { className: "vc-status", textContent: " click a thumbnail to open it in an Explorer" }));
  root.append(header, display.node, errorBox, gridNode);

  function build() {
    const [rows, cols] = model.get("maps_shape");
    const rowField = model.get("row_field");
    const colField = model.get("col_field");
    const rowLabels = model.get("row_labels");
    const colLabels = model.get("col_labels");
    const degenerate = model.get("degenerate");
    const causes = model.get("causes") || [];
    const ids = model.get("recipe_ids");
    gridNode.replaceChildren();
    cells.length = 0;
    gridNode.style.gridTemplateColumns = `auto repeat(${cols}, ${model.get("thumb") + 4}px)`;
    gridNode.append(h("div", { className: "vc-axis", textContent: rowField ? `${rowField} \\ ${colField}` : colField }));
    for (let j = 0; j < cols; j++) gridNode.append(h("div", { className: "vc-axis", textContent: colLabels[j] }));
    for (let i = 0; i < rows; i++) {
      gridNode.append(h("div", { className: "vc-axis", textContent: rowLabels[i] }));
      for (let j = 0; j < cols; j++) {
        const canvas = h("canvas", { className: "vc-thumb" });
        const why = degenerate[i][j];
        const cause = why ? (causes[i] || [])[j] || "degenerate" : "";
        const label = `${rowField ? `${rowField} ${rowLabels[i]}, ` : ""}${colField} ${colLabels[j]} — recipe ${ids[i][j]}`;
        const button = h("button", {
          type: "button", className: "vc-cell", title: why ? `${label} (degenerate, ${cause}: ${why})` : label,
          dataset: { row: String(i), col: String(j), recipeId: ids[i][j] },
        }, canvas, why ? h("span", { className: "vc-badge", textContent: cause }) : null);
        button.setAttribute("aria-label", label);
        button.addEventListener("click", () => {
          clicks += 1;
          model.set("selected", { cell: [i, j], n: clicks });
          model.save_changes();
        });
        gridNode.append(button);
        cells.push({ i, j, canvas, button });
      }
    }
    paintAll();
    markActive();
  }

  function paintAll() {
    const [, , gh, gw] = model.get("maps_shape");
    const [ih, iw] = model.get("image_shape");
    const thumb = model.get("thumb");
    const width = thumb;
    const height = Math.max(1, Math.round((thumb * ih) / Math.max(iw, 1)));
    const cols = model.get("maps_shape")[1];
    const all = model.get("maps");
    for (const { i, j, canvas } of cells) {
      const grid = floatsOf(all, (i * cols + j) * gh * gw, gh * gw);
      paintOverlay(canvas, image, grid, gh, gw, {
        width, height, mode: model.get("upsample"), normalize: model.get("normalize"),
        cmap: model.get("colormap"), opacity: model.get("opacity"),
      });
    }
    root.dataset.paintCount = String(Number(root.dataset.paintCount) + 1);
  }

  function markActive() {
    const active = model.get("active") || [];
    for (const { i, j, button } of cells) {
      button.classList.toggle("vc-active", active.length === 2 && active[0] === i && active[1] === j);
    }
  }

  function showError() {
    const error = model.get("error");
    errorBox.hidden = !error;
    errorBox.textContent = error;
  }

  const onDisplay = () => {
    display.sync();
    paintAll();
  };
  const onImage = () => {
    image = imageCanvas(model.get("image"), model.get("image_shape"));
    paintAll();
  };
  const unlisten = listen(model, {
    "change:maps": build, "change:thumb": build, "change:image": onImage, "change:active": markActive,
    "change:error": showError, "change:opacity": onDisplay, "change:colormap": onDisplay,
  });
  build();
  showError();
  root.dataset.ready = "true";
  return unlisten;
}

export default { render };
