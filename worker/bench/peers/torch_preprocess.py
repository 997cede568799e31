#!/usr/bin/env python3
"""PyTorch peers of `stoker-worker bench preprocess`: ResNet-50 training transforms (decode,
random-resized-crop 224, horizontal flip, normalize to float32) over the same image folder in a
`DataLoader` with `--workers` processes, batched by 64. Prints images/s and images/s per core.

    python3 worker/bench/peers/torch_preprocess.py --corpus /tmp/stoker-bench-corpus --recipe torchvision

Recipes:
- torchvision: the strongest: `torchvision.io.decode_jpeg` on the file's bytes, then
  `transforms.v2` RandomResizedCrop(224, antialias) + RandomHorizontalFlip on the uint8 tensor,
  then ToDtype(float32, scale) + Normalize.
- pil: the classic `ImageFolder` recipe: PIL open + convert RGB, RandomResizedCrop(224),
  RandomHorizontalFlip, ToTensor, Normalize.
"""

import argparse
import os
import pathlib

import epochs

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def items(corpus):
    classes = sorted(p.name for p in pathlib.Path(corpus).iterdir() if p.is_dir())
    return [(str(f), i) for i, c in enumerate(classes) for f in sorted((pathlib.Path(corpus) / c).glob("*.jpg"))]


class Torchvision:
    def __init__(self, corpus):
        import torch
        from torchvision.transforms import v2

        self.items = items(corpus)
        self.transform = v2.Compose(
            [
                v2.RandomResizedCrop(224, antialias=True),
                v2.RandomHorizontalFlip(),
                v2.ToDtype(torch.float32, scale=True),
                v2.Normalize(MEAN, STD),
            ]
        )

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        from torchvision.io import decode_jpeg, read_file

        path, label = self.items[index]
        return self.transform(decode_jpeg(read_file(path))), label


class Pil:
    def __init__(self, corpus):
        from torchvision import transforms

        self.items = items(corpus)
        self.transform = transforms.Compose(
            [
                transforms.RandomResizedCrop(224),
                transforms.RandomHorizontalFlip(),
                transforms.ToTensor(),
                transforms.Normalize(MEAN, STD),
            ]
        )

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        from PIL import Image

        path, label = self.items[index]
        with open(path, "rb") as f:
            image = Image.open(f).convert("RGB")
        return self.transform(image), label


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--recipe", choices=["torchvision", "pil"], default="torchvision")
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    import torch
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    dataset = (Torchvision if args.recipe == "torchvision" else Pil)(args.corpus)
    loader = DataLoader(
        dataset, batch_size=64, shuffle=True, num_workers=args.workers, persistent_workers=True, prefetch_factor=4
    )
    epochs.best_of(args.repeat, lambda: loader, args.workers)


if __name__ == "__main__":
    main()
