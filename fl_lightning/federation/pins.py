"""Pinned external files that two layers name: the fetch catalog (``data.catalog``) downloads and checks them,
the model builders (``models.pretrained``) load them."""

# the ViT-B/16 weights: the Hub repository and the commit whose files `flrun data fetch vit_b16` checks
VIT_ID, VIT_REVISION = "google/vit-base-patch16-224-in21k", "b4569560a39a0f1af58e3ddaf17facf20ab919b0"
