"""Composable, content-addressed EROFS layers and the images (layer stacks) built from them."""
from .store import ImageInfo, LayerInfo, LayerStore, split_ref

__all__ = ["ImageInfo", "LayerInfo", "LayerStore", "split_ref"]
