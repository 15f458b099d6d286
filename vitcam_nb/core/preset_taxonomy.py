"""Each preset in the audit's five categories (site, target, tokens, aggregation, reconstruction), with its
paper and official code (a URL or "none"). ``docs/presets.md`` is generated from it (scripts/presets_table.py),
and a test keeps every preset in it.

Example:
    >>> TAXONOMY["attention_rollout"]["target"]
    'none (no gradient)'
"""

from __future__ import annotations

from vitcam_nb.core.presets import CITATIONS, PRESET_ROWS, discover_presets
from vitcam_nb.core.presets_rules import RULE_TAXONOMY
from vitcam_nb.core.presets_vlm import VLM_TAXONOMY

__all__ = ["PGC", "TAXONOMY"]

# Every preset module registers its presets and citations (read below) before the table is built.
discover_presets()

PGC = "https://github.com/jacobgil/pytorch-grad-cam"
_F1_LAST = "F1, the output of blocks[-1].norm1 (the last block)"
_LOGIT = "the logit of the top-1 class"
_PATCH_POOL = "class token dropped (reshape_transform); channel weights pooled over the patch tokens"
_PER_TOKEN = "class token dropped (reshape_transform); per token, no pooling"
_RASTER = "row-major patch grid, ReLU, min-max, bilinear resize to the input"
_ROLL_TOKENS = "the CLS query row; patch keys on the grid"


def _pgc(paper: str, aggregation: str, tokens: str = _PATCH_POOL, target: str = _LOGIT) -> dict[str, str]:
    return {"paper": paper, "code": PGC, "site": _F1_LAST, "target": target, "tokens": tokens,
            "aggregation": aggregation, "reconstruction": _RASTER}


#: Each preset in the audit's five categories (site, target, tokens, aggregation, reconstruction), with its paper
#: and official code (a URL or "none"); ``docs/presets.md`` is generated from it (scripts/presets_table.py).
TAXONOMY: dict[str, dict[str, str]] = {
    "pytorch_grad_cam_vit": _pgc("Gildenblat et al., pytorch-grad-cam (library, ViT tutorial)",
                                 "gradcam: alpha_k = mean_t G[t,k], map = sum_k alpha_k A[t,k]"),
    "gradcam": _pgc("Selvaraju et al. 2017, ICCV", "gradcam: alpha_k = mean_t G[t,k], map = sum_k alpha_k A[t,k]"),
    "hirescam": _pgc("Draelos & Carin 2020, arXiv:2011.08891", "hirescam: map = sum_k G[t,k] A[t,k]", _PER_TOKEN),
    "gradcam_elementwise": _pgc("none (pytorch-grad-cam GradCAMElementWise)",
                                "map = sum_k relu(G[t,k] A[t,k])", _PER_TOKEN),
    "gradcampp": _pgc("Chattopadhay et al. 2018, WACV", "Grad-CAM++ second-order channel weights"),
    "xgradcam": _pgc("Fu et al. 2020, BMVC", "alpha_k = sum_t G A / (sum_t A + 1e-7)"),
    "layercam": _pgc("Jiang et al. 2021, IEEE TIP", "map = sum_k relu(G[t,k]) A[t,k]", _PER_TOKEN),
    "eigencam": _pgc("Muhammad & Yeasin 2020, IJCNN", "first principal component of A (sign fixed)", _PER_TOKEN,
                     "none (gradient-free)"),
    "eigengradcam": _pgc("none (pytorch-grad-cam EigenGradCAM)", "first principal component of G * A", _PER_TOKEN),
    "chefer_attention_gradcam": {
        "paper": "Chefer, Gur & Wolf 2021, CVPR (the Grad-CAM baseline)",
        "code": "https://github.com/hila-chefer/Transformer-Explainability", "site": "F2, the last block",
        "target": _LOGIT, "tokens": "the CLS query row; head weights pooled over patch keys",
        "aggregation": "heads weighted by their mean gradient, mean over heads, then ReLU", "reconstruction": _RASTER},
    "attention_rollout": {
        "paper": "Abnar & Zuidema 2020, ACL", "code": "https://github.com/samiraabnar/attention_flow",
        "site": "F2, every block", "target": "none (no gradient)", "tokens": _ROLL_TOKENS,
        "aggregation": "R = prod_l (0.5 mean_h A_l + 0.5 I)", "reconstruction": _RASTER},
    "gradient_rollout": {
        "paper": "Chefer, Gur & Wolf 2021b, ICCV", "code": "https://github.com/hila-chefer/Transformer-MM-Explainability",
        "site": "F2, every block", "target": _LOGIT, "tokens": _ROLL_TOKENS,
        "aggregation": "R <- R + mean_h(relu(G_l * A_l)) R from R = I", "reconstruction": _RASTER},
    "legrad_style": {
        "paper": "after Bousselham et al. 2024 (LeGrad)", "code": "https://github.com/WalBouss/LeGrad",
        "site": "F2, every block", "target": _LOGIT, "tokens": "mean over all query rows (before the ReLU)",
        "aggregation": "relu(G) per head, mean over heads, summed over layers", "reconstruction": _RASTER},
    "transition_attention_maps": {
        "paper": "Yuan et al. 2021, NeurIPS XAI4Debugging workshop",
        "code": "https://github.com/XianrenYty/Transition_Attention_Maps",
        "site": "F2 of the last 8 blocks; integrated gradient of the last attention (vc.score, 20 steps)",
        "target": _LOGIT, "tokens": _ROLL_TOKENS,
        "aggregation": "mean_h A_L (mean_h A_l + I)... times mean_h relu(IG)", "reconstruction": _RASTER},
    "beyond_intuition_head": {
        "paper": "Chen et al. 2023, TMLR (BT-H)", "code": "https://github.com/jiaminchen-1031/transformerinterp",
        "site": "F2 and its gradient from block L-9; integrated gradient of the last attention (vc.score)",
        "target": _LOGIT, "tokens": _ROLL_TOKENS,
        "aggregation": "R <- R + (sum_h I_h A_h) R, I_h = mean|A_h^T G_h| normalised; times mean_h relu(IG)",
        "reconstruction": _RASTER},
    "beyond_intuition_token": {
        "paper": "Chen et al. 2023, TMLR (BT-T)", "code": "https://github.com/jiaminchen-1031/transformerinterp",
        "site": "F2 and |v W_o| / |z| from block L-7; integrated gradient of the last attention (vc.score)",
        "target": _LOGIT, "tokens": _ROLL_TOKENS,
        "aggregation": "R <- R + mean_h(A_l) diag(|v W_o|/|z|) R; times mean_h relu(IG), |R|",
        "reconstruction": _RASTER},
    "vit_cx": {
        "paper": "Xie et al. 2023, IJCAI", "code": "https://github.com/vaynexie/CausalX-ViT",
        "site": _F1_LAST + "; masked inputs scored by vc.score",
        "target": "the softmax probability of the top-1 class", "tokens": "class token dropped; every channel a mask",
        "aggregation": "clustered channel masks weighted by their causal impact score with noise",
        "reconstruction": "masks resized bilinearly before clustering; no ReLU; min-max"},
    "albef_itm_gradcam": {
        "paper": "Li et al. 2021, NeurIPS (ALBEF)", "code": "https://github.com/salesforce/ALBEF",
        "site": "xattn: cross-attention of text layer 8 over image patches",
        "target": "the ITM 'match' logit (class 1)", "tokens": "the first text row ([CLS]/[ENC]); patch keys",
        "aggregation": "mean over heads of A * relu(G)", "reconstruction": _RASTER},
}
# The published attention-gradient methods (vitcam_nb/core/presets_attention.py).
TAXONOMY.update({
    "grad_sam": {"paper": CITATIONS["grad_sam"], "code": "none",
                 "site": "F2 softmax attention and its gradient, every block",
                 "target": "class logit (any vc target)",
                 "tokens": "CLS query row, patch keys",
                 "aggregation": "A * relu(dA), mean over heads, mean over layers",
                 "reconstruction": "raster grid, bilinear upsampling, min-max"},
    "attcat": {"paper": CITATIONS["attcat"], "code": "https://github.com/qiangyao1988/AttCAT",
               "site": "hidden state entering each block (resid_pre) and its gradient; F2 attention",
               "target": "class logit",
               "tokens": "all tokens weighted; attention averaged over query rows; patch tokens mapped",
               "aggregation": "sum_k h*dh per token times mean-head attention, summed over layers, signed",
               "reconstruction": "raster grid, bilinear upsampling, min-max"},
    "agcam": {"paper": CITATIONS["agcam"], "code": "https://github.com/LeemSaebom/Attention-Guided-CAM-Visual-"
                                                    "Explanations-of-Vision-Transformer-Guided-by-Self-Attention",
              "site": "pre-softmax scores (attn_scores) and the softmax attention's gradient, every block",
              "target": "class logit",
              "tokens": "CLS query row, patch keys",
              "aggregation": "sigmoid(S) * relu(dA), summed over heads and layers",
              "reconstruction": "raster grid, bilinear upsampling, min-max"},
    "legrad": {"paper": CITATIONS["legrad"], "code": "https://github.com/WalBouss/LeGrad",
               "site": "F2 softmax attention gradient of the last two blocks (official layer_index=-2)",
               "target": "per block: the final norm of the mean over all tokens (class token included), then the "
                         "projection or head (vc.targets.layerwise, readout='mean')",
               "tokens": "mean over all query rows, patch keys",
               "aggregation": "relu(ds_l/dA_l), mean over heads and rows, summed over layers",
               "reconstruction": "raster grid, bilinear upsampling, min-max"},
    "legrad_cls": {"paper": CITATIONS["legrad_cls"], "code": "https://github.com/WalBouss/LeGrad",
                   "site": "F2 softmax attention gradient of every block",
                   "target": "per block: its output through the final norm, the model's own pooling (class token) "
                             "and head (vc.targets.layerwise, readout='model'); the kit's variant",
                   "tokens": "mean over all query rows, patch keys",
                   "aggregation": "relu(ds_l/dA_l), mean over heads and rows, summed over layers",
                   "reconstruction": "raster grid, bilinear upsampling, min-max"},
    "grad_eclip": {"paper": CITATIONS["grad_eclip"], "code": "https://github.com/Cyang-Zhao/Grad-Eclip",
                   "site": "last block: F3 gradient at CLS, values v, q and k through out_proj (q_out, k_out), "
                           "single-head recompute",
                   "target": "cosine of image and text embeddings (vc.targets.similarity / prompts)",
                   "tokens": "CLS gradient and query; patch values and keys",
                   "aggregation": "relu(sum_c g_c v_pc minmax cos(q_out_cls, k_out_p)), cosine over all channels",
                   "reconstruction": "raster grid, bilinear upsampling, min-max"},
    "grad_eclip_paper": {"paper": CITATIONS["grad_eclip_paper"], "code": "https://github.com/Cyang-Zhao/Grad-Eclip",
                         "site": "last block: F3 gradient at CLS, values v, queries q and keys k (multi-head)",
                         "target": "cosine of image and text embeddings",
                         "tokens": "CLS gradient and query; patch values and keys",
                         "aggregation": "relu(sum_h sum_(c in h) g_c v_pc minmax cos(q^h_cls, k^h_p))",
                         "reconstruction": "raster grid, bilinear upsampling, min-max"},
})
TAXONOMY.update(RULE_TAXONOMY)

# TokenTM (vitcam_nb/core/presets_tokentm.py), as the LibraGrad authors' code computes it.
TAXONOMY["tokentm"] = {
    # "code" is the official code: TokenTM's was not found; the formula's source is named in the citation
    "paper": CITATIONS["tokentm"], "code": "none",
    "site": "F2 attention and its gradient; resid_pre, resid_mid, F6 of every block (no extra pass)",
    "target": "class logit",
    "tokens": "CLS row of the contribution matrix, patch columns",
    "aggregation": "C = diag(|x|); per block C <- (I + diag(w_mlp)) (I + (mean_h A diag(w_attn)) * mean_h relu(dA)) "
                   "C; w = length ratio * softmax over tokens of the cosine, resid_pre->resid_mid and resid_mid->F6",
    "reconstruction": "raster grid, bilinear upsampling, min-max",
}

# A generative VLM's answer (vitcam_nb/core/presets_vlm.py).
TAXONOMY.update(VLM_TAXONOMY)
# The rows of presets that register their own (a preset module added without editing this table), after the
# built-in rows.
TAXONOMY.update(PRESET_ROWS)
