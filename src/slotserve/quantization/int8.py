"""Int8 weights for CPU decode: the model's nn.Linear layers become dynamically quantized ones.

Batch-1 decode on CPU is bound by the weight bytes streamed per token; int8 weights are a quarter of
float32's. The kernel is the one torch ships for dynamic quantization (fbgemm, `quantized::linear_dynamic`
on a prepacked weight): int8 weights with one scale per output channel, activations quantized to uint8
on the fly, products accumulated in int32, the result dequantized to float32.

That kernel picks one activation scale for the whole input tensor. In a batch, one request's scale
would then depend on the other requests (and on a prompt's outlier tokens), so greedy output would
change with the company a request keeps. `Int8Linear` therefore scales each row to a max-abs of 1
first and appends two columns, 1 and -1, to every row (met by two zero columns of the weight), which
pins the tensor's range to exactly [-1, 1]: the kernel's scale is then the same whatever the batch,
each token keeps its own resolution, and since the int32 products are exact, a row's result is
bitwise the same alone or batched. (Columns rather than one extra row: the kernel is ~20 % faster
for one row than for two, and batch-1 decode is the case this is for.)

torch 2.13 marks quantized tensors, which the prepack step takes, as deprecated (pytorch#184982):
when they go, this needs another shipped int8 kernel (torchao's) behind the same `Int8Linear`.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn

_TINY = torch.finfo(torch.float32).tiny


@functools.cache
def _weight_max() -> int:
    """The largest int8 weight magnitude the kernel multiplies exactly by any uint8 activation.

    Kernels built on pairwise u8*s8 sums in int16 (x86 without VNNI) saturate once two products reach
    2 * 255 * 127. The stock module avoids that by quantizing activations to 7 bits (`reduce_range`),
    which costs accuracy where it hurts most: the heavy-tailed inputs of down_proj (measured on the
    default model: 6-9 % error per layer against 3-5 % with 8-bit activations). Here activations keep
    8 bits; the weights use the full -127..127 where a worst-case probe comes out exact, and
    -63..63 (whose pair sums cannot saturate) where it does not."""
    weight = torch.ones(1, 64)
    x = torch.ones(2, 64)
    x[1] = -1  # the range [-1, 1]: +1 becomes uint8 255
    out = torch.ops.quantized.linear_dynamic(x, torch.ops.quantized.linear_prepack(_quantize(weight, 127), None),
                                             reduce_range=False)
    return 127 if abs(out[0, 0].item() - 64) < 1 else 63


def _quantize(weight: torch.Tensor, weight_max: int) -> torch.Tensor:
    """Symmetric per-output-channel int8 (a quantized qint8 tensor): scale = row max-abs / weight_max."""
    weight = weight.detach().float()
    scales = (weight.abs().amax(dim=1) / weight_max).clamp_min(_TINY).double()
    zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
    # torch 2.13 warns that quantized tensors are deprecated; the prepack kernel still takes only them.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        return torch.quantize_per_channel(weight, scales, zero_points, axis=0, dtype=torch.qint8)


class Int8Linear(nn.Module):
    """y = x W^T + b with W in int8 (fbgemm-packed) and x quantized per row at run time."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Two zero columns meet the two range columns that forward appends to every input row.
        weight = linear.weight if linear.weight is not None else linear.packed.dequantize()  # a GGUF's packing
        weight = torch.nn.functional.pad(weight.detach(), (0, 2))
        self._packed = torch.ops.quantized.linear_prepack(_quantize(weight, _weight_max()), None)
        self.register_buffer("_range", torch.tensor([[1.0, -1.0]]), persistent=False)
        # The bias is added after the rows are scaled back, so it stays out of the packed weight
        # (and stays the checkpoint's tensor, a view of the memory-mapped file).
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, in_features], the engine's flat batch. Few ops on purpose: at batch 1 each one's
        Python and dispatch cost is a tenth of the kernel's, and a token of a 24-layer model runs 169."""
        scale = x.abs().amax(dim=1, keepdim=True).clamp_min_(_TINY)  # (vector_norm(inf) is 10x slower here)
        scaled = torch.cat((x / scale, self._range.expand(len(x), 2)), dim=1)
        y = torch.ops.quantized.linear_dynamic(scaled, self._packed, reduce_range=False)
        return y.mul_(scale) if self.bias is None else torch.addcmul(self.bias, y, scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replaces every nn.Linear of a loaded model (in place) with an `Int8Linear`; returns the model.

    Quantize after the weights load: the float weights of each replaced layer are then released
    (dropped views of the checkpoint file). A head tied to the embedding gets its own int8 copy,
    and the embedding keeps the float tensor, which lookups need."""
    engine = torch.backends.quantized.engine
    if engine not in ("x86", "fbgemm"):
        raise ValueError(f"quantization: int8 needs torch's x86/fbgemm quantized engine, this build uses {engine!r}")
    targets = [(name, module) for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and not getattr(module, "keeps_float", False)]
    for name, linear in targets:
        if linear.weight.device.type != "cpu":
            raise ValueError(f"quantization: int8 runs on CPU only; {name} is on {linear.weight.device}")
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, Int8Linear(linear))
    return model
