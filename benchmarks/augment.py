"""The self-supervised methods' views: time per image of each ``ssl-augment`` implementation.

Per-sample (torchvision v2, one call per image, on the CPU) against batched (kornia, a batch at
once with per-sample parameters) on the CPU with one thread (a client's share with
``--cpus-per-client 1``) and, where torch sees one, on the GPU. A batch of 128 uint8 images, as
``training.ssl_epochs`` hands them over, to the pixel values ``DataSet.normalise`` takes; the
GPU figures include the copy of the batch to the GPU and wait for the kernels to finish.

Usage: .venv/bin/python -m benchmarks.augment [--batch 128] [--repeats 20]
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import run_main, write_result
from flowerbed.cli import int_in
from flowerbed.datasets.augment import Augmenter

SHAPES = {"1x28x28 (Fashion-MNIST, MNIST)": (1, 28), "3x32x32 (CIFAR, SVHN)": (3, 32)}


def ms_per_image(augment: Augmenter, batch: torch.Tensor, repeats: int) -> float:
    def sync() -> None:
        if augment.device.type == "cuda":
            torch.cuda.synchronize(augment.device)

    augment(batch)  # warm-up (kornia's first call builds its modules' state)
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        augment(batch)
    sync()
    return 1e3 * (time.perf_counter() - t0) / (repeats * len(batch))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int_in(2), default=128)
    ap.add_argument("--repeats", type=int_in(1), default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    rows = []
    for shape, (c, size) in SHAPES.items():
        batch = torch.randint(0, 256, (args.batch, c, size, size), dtype=torch.uint8)
        per_sample = ms_per_image(Augmenter(c, size, "per-sample"), batch, args.repeats)
        for device in devices:
            batched = ms_per_image(Augmenter(c, size, "batched", device), batch, args.repeats)
            rows.append({"images": shape, "batched-device": device.type, "per-sample-ms": per_sample,
                         "batched-ms": batched, "speed-up": per_sample / batched})
            print(f"{shape}: per-sample {per_sample:.3f} ms/image (CPU, 1 thread), batched on "
                  f"{device.type} {batched:.3f} ms/image: {per_sample / batched:.1f}x", flush=True)
    write_result("augment", {"batch": args.batch, "repeats": args.repeats, "threads": 1, "rows": rows})


if __name__ == "__main__":
    run_main(main)
