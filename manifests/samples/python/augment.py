"""Colour jitter for image-python-augment.yaml: brightness, contrast and saturation each scaled
by a random factor in [1 - strength, 1 + strength], as torchvision's ColorJitter does, on the
uint8 [height, width, 3] image Stoker's decode and crop made (with `layout: planar`, each channel
contiguous in memory, as torchvision's decoded tensors are). `rng` is seeded per (seed, epoch,
element, op), so a run repeats exactly whichever worker processes the element."""

import numpy as np

STRENGTH = 0.4


def grey(image):
    # Elementwise, not `image @ weights`: a matmul over a contiguous [h, w, 3] array is a BLAS
    # call per pixel, ten times slower.
    return 0.299 * image[..., 0] + 0.587 * image[..., 1] + 0.114 * image[..., 2]


def color_jitter(element, rng):
    image = element["image"].astype(np.float32)
    brightness, contrast, saturation = rng.uniform(1 - STRENGTH, 1 + STRENGTH, size=3).astype(np.float32)
    image *= brightness
    mean = grey(image).mean()
    image = (image - mean) * contrast + mean
    luma = grey(image)[..., None]
    image = (image - luma) * saturation + luma
    element["image"] = np.clip(image, 0, 255).astype(np.uint8)
    return element


def color_jitter_batch(elements, rngs):
    """The batched form (`batch: n` on the op): each element with its own generator, so the
    output is the same as one element per call."""
    return [color_jitter(element, rng) for element, rng in zip(elements, rngs)]
