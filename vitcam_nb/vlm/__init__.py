"""Vision-language models: open_clip image towers with text-prompt targets (``vitcam_nb[clip]``) and BLIP
image-text matching with the cross-attention site ``xattn`` (``vitcam_nb[vlm]``).

The optional packages are imported only when these modules are used, so the core stays light.
"""
