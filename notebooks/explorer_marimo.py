"""The Explorer in marimo: trace the bundled model once, then slice the trace live.

Run: ``marimo edit notebooks/explorer_marimo.py`` (or ``marimo run`` for the app view). The Explorer is an
anywidget, so ``mo.ui.anywidget`` shows it with no extension and no network: its JavaScript ships inside
vitcam_nb. Its value (``explorer.value``) is the synced state; the recipe shown is ``explorer.widget.recipe``.
"""

import marimo

app = marimo.App(width="medium")


@app.cell
def _():
    import marimo as mo

    import vitcam_nb as vc

    return mo, vc


@app.cell
def _(vc):
    # The bundled model (trained on synthetic shapes, shipped in the package): no download, a second to trace.
    model = vc.load_model("shapes-vit")
    image, label, mask = vc.sample_image("shapes", 0, with_mask=True)
    tr = vc.trace(model, image, targets="top3")
    return (tr,)


@app.cell
def _(mo, tr, vc):
    explorer = mo.ui.anywidget(vc.Explorer(tr, vc.Recipe(site="F1", layer=-1)))
    explorer  # noqa: B018 (marimo shows the last expression of a cell)
    return (explorer,)


@app.cell
def _(explorer, mo):
    # Re-runs whenever a control changes the recipe: the id below is the map the Explorer shows.
    mo.md(f"Recipe shown: `{explorer.value['recipe_id']}`")
    return


if __name__ == "__main__":
    app.run()
