import numpy as np, torch, timm, vitcam_nb as vc
print(vc.__file__)
torch.manual_seed(0)
m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2, num_heads=2, embed_dim=16, num_classes=5).eval()
img = np.random.default_rng(0).integers(0,256,(32,32,3),dtype=np.uint8)
tr = vc.trace(m, img, targets=[1,2], sites=["F2","attn_scores","q","k","v","F1"])
print(tr)
S = tr.attn_scores.values; A = tr.attn.values
print(np.abs(torch.softmax(torch.tensor(S),-1).numpy()-A).max())
q = tr.act.sel(site="q").values; k = tr.act.sel(site="k").values
q = q.reshape(2,17,2,8).transpose(0,2,1,3); k = k.reshape(2,17,2,8).transpose(0,2,1,3)
print(np.abs(q@k.transpose(0,1,3,2)*8**-0.5 - S).max())
G = tr.attn_grad.values; GS = tr.attn_scores_grad.values
ref = A*(G - (G*A).sum(-1,keepdims=True))
print(np.abs(ref-GS).max(), np.abs(GS).max())
tr0 = vc.trace(m, img, targets=[1])
print(list(tr0.site.values), "attn_scores" in tr0)
