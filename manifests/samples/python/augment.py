"""Colour jitter for image-python-augment.yaml: brightness, contrast and saturation each scaled
by a random factor in [1 - strength, 1 + strength], as torchvision's ColorJitter does, on the
uint8 [height, width, 3] image Stoker's decode and crop made. `rng` is seeded per (seed, epoch,
element, op), so a run repeats exactly whichever worker processes the element."""

import numpy as np

STRENGTH = 0.4
GREY = np.array([0.299, 0.587, 0.114], dtype=np.float32)


def color_jitter(element, rng):
    image = element["image"].astype(np.float32)
    brightness, contrast, saturation = rng.uniform(1 - STRENGTH, 1 + STRENGTH, size=3)
    image *= brightness
    grey = image @ GREY
    image = (image - grey.mean()) * contrast + grey.mean()
    grey = (image @ GREY)[..., None]
    image = (image - grey) * saturation + grey
    element["image"] = np.clip(image, 0, 255).astype(np.uint8)
    return element
