"""``contrastive_dist.compat.siglip_kernel``'s SigLIP+ against siglip-kernel 0.1.2's own Triton kernel, on the CPU.

siglip-kernel runs on CUDA only (its import asks the GPU for its architecture). Triton's interpreter
(``TRITON_INTERPRET=1``) runs its kernels on the CPU instead: this script sets it, answers the
architecture query as a Hopper GPU would, and compares ``SigLIPPlusLoss``'s value, feature, scale
and bias gradients and ``n_positives`` with the drop-in's, float32, on rectangular batches with
repeated group ids, rows and captions without a positive, symmetric or not, soft labels or not.
On a GPU, ``benchmarks/gpu_check.py``'s conformance section runs the real kernels instead. Run::

    pip download --no-deps siglip-kernel==0.1.2 -d .whl && unzip -oq .whl/siglip_kernel-0.1.2-*.whl -d .whl/site
    PYTHONPATH=.:.whl/site python benchmarks/siglip_kernel_conformance.py
"""

from __future__ import annotations

import os

import torch

CASES = ((6, 10, True, False, 4), (5, 7, False, False, 3), (8, 8, True, True, 8), (4, 9, False, True, 2),
         (7, 12, True, False, 5))  # images, captions, symmetric, soft_label, group ids drawn from  # fmt: skip
NAMES = ("value", "images", "captions", "logit_scale", "logit_bias", "n_positives")


def main() -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if not torch.cuda.is_available():  # the interpreter stands in for the GPU siglip-kernel asks for
        torch.cuda.get_device_capability = lambda *args, **kwargs: (9, 0)  # type: ignore[assignment]
    import siglip_kernel

    from contrastive_dist.compat import siglip_kernel as drop_in

    generator = torch.Generator().manual_seed(0)
    print("| N | M | symmetric | soft_label | " + " | ".join(f"max abs diff: {name}" for name in NAMES) + " |")
    print("|---:|---:|---|---|" + "---:|" * len(NAMES))
    for images, captions, symmetric, soft_label, groups in CASES:
        x, y = torch.randn(images, 16, generator=generator), torch.randn(captions, 16, generator=generator)
        image_ids = torch.randint(0, groups, (images,), generator=generator)
        text_ids = torch.randint(0, groups + 1, (captions,), generator=generator)
        results = []
        for module in (siglip_kernel.SigLIPPlusLoss, drop_in.SigLIPPlusLoss):
            criterion = module(temperature=0.1, symmetric=symmetric, soft_label=soft_label, bias_init=-1.0)
            features = x.clone().requires_grad_(), y.clone().requires_grad_()
            out = criterion(features, image_ids, text_ids)
            out["total_loss"].backward()
            results.append([out["total_loss"].detach(), *(tensor.grad for tensor in features),
                            criterion.logit_scale.grad, criterion.logit_bias.grad, out["n_positives"]])  # fmt: skip
        differences = [(ours.double() - theirs.double()).abs().max().item() for theirs, ours in zip(*results)]
        print(f"| {images} | {captions} | {symmetric} | {soft_label} | "
              + " | ".join(f"{difference:.1e}" for difference in differences) + " |")


if __name__ == "__main__":
    main()
