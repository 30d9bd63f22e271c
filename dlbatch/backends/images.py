"""A request's images for an engine: the compressed bytes the prompt stage put in the request
row (PNG, JPEG or WebP, in prompt order; dlbatch/prompts/multimodal.py) decoded here, in the
worker, right before the engine's own processor takes them. Nothing upstream decodes them:
the driver moves bytes only."""
from __future__ import annotations


def decode_images(images) -> list:
    """Compressed images (bytes) -> PIL images in RGB, in order; a bad image is the request's
    error, naming its position."""
    import io

    from PIL import Image

    out = []
    for i, data in enumerate(images):
        try:
            im = Image.open(io.BytesIO(bytes(data)))
            im.load()
        except Exception as e:
            raise ValueError(f"image {i + 1} of the request cannot be decoded: {type(e).__name__}: {e}") from None
        out.append(im.convert("RGB") if im.mode != "RGB" else im)
    return out
