"""How much noisier a stochastic quantizer gets when its scale spans a fused bucket.

QSGD's variance bound (Alistarh et al., NeurIPS 2017, Lemma 3.1) grows with the number of elements
d that share one norm: E‖Q(g) − g‖² ≤ min(d/s², √d/s)·‖g‖². Fusing a model's tensors into one bucket
with one norm (``chunk=0``) therefore changes the method's statistics; a fixed chunk does not. This
script measures the relative squared error E‖Q(g) − g‖² / ‖g‖², by sampling, on the real gradients
of torchvision ResNet-18 (CIFAR stem, a random batch of 32) for:

- layer-wise: each tensor quantized alone with one scale (the paper's per-layer use);
- fused: all 62 tensors in one bucket, with one scale per bucket (``chunk=0``) and per chunk of
  128 and 512 elements (512 is the default).

    python benchmarks/quantizer_variance.py --samples 20
"""

from __future__ import annotations

import argparse

import torch
from cli import integer_at_least
from sidco_estimators import resnet18_gradients

from gc_strategy import COMPRESSORS
from gc_strategy.bucket import Bucket

#: (label, compressor, options)
QUANTIZERS = [
    ("qsgd s=127", "qsgd", dict(levels=127)),
    ("qsgd s=7", "qsgd", dict(levels=7)),
    ("terngrad", "terngrad", dict(clip_sigma=2.5)),
]
FUSED_CHUNKS = (0, 512, 128)


def relative_squared_error(name: str, options: dict, tensors: list[torch.Tensor], samples: int) -> float:
    """E‖Q(g) − g‖² / ‖g‖² for ``g`` the concatenation of ``tensors``, fused into one bucket."""
    g = torch.cat(tensors)
    bucket = Bucket(
        0, [f"t{i}" for i in range(len(tensors))], [t.shape for t in tensors], torch.float32, torch.device("cpu")
    )
    compressor = COMPRESSORS.build(name, **options)
    error = 0.0
    for step in range(samples):
        compressor.begin_step(step)
        error += float((compressor.decode(compressor.encode(g, bucket), bucket) - g).square().sum())
    return error / samples / float(g.square().sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=integer_at_least(1), default=20, help="draws per configuration")
    args = parser.parse_args()
    gradients = resnet18_gradients()
    total = sum(float(t.square().sum()) for t in gradients)
    print(
        f"ResNet-18 gradients: {len(gradients)} tensors, {sum(t.numel() for t in gradients):,} elements; "
        f"{args.samples} samples each"
    )
    print(f"{'quantizer':<12} {'layer-wise':>12} " + " ".join(f"{f'fused chunk={c}':>18}" for c in FUSED_CHUNKS))
    for label, name, options in QUANTIZERS:
        layerwise = (
            sum(
                relative_squared_error(name, {**options, "chunk": 0}, [t], args.samples) * float(t.square().sum())
                for t in gradients
            )
            / total
        )
        fused = [relative_squared_error(name, {**options, "chunk": c}, gradients, args.samples) for c in FUSED_CHUNKS]
        print(f"{label:<12} {layerwise:>12.4g} " + " ".join(f"{v:>18.4g}" for v in fused))


if __name__ == "__main__":
    main()
