"""BatchNorm1d in training over a Linear's output, with the Linear's bias and an optional ReLU
after it, in pure PyTorch with its own backward, written so that Inductor generates the two
passes over [B, N] each direction needs (the `linear_batchnorm` Mod emits it).

    y = relu(batch_norm(h + bias, running_mean, running_var, weight, beta, training=True))
    h = x @ W^T  [B, N]     (the Linear without its bias)

Forward (fp32 inside, y in h's dtype): the batch mean and biased variance of h, the running
statistics updated as BatchNorm does (momentum, unbiased variance; the running mean gets the
bias added to the batch mean), y = relu((h - mean) * rstd * weight + beta). The bias cancels in
the normalization, so it is added to the mean it shifts rather than to every element.

Backward, from h, mean and rstd alone (y is not read: the ReLU mask is recomputed from h):
    one column-reduction pass over dy and h:  sum(g), sum(g * xhat)   (g: dy where the mask is set)
    one pointwise pass over dy and h:          dh = k (g - sum(g) / B - xhat sum(g * xhat) / B)
with dweight = sum(g * xhat), dbeta = sum(g), and the Linear's bias gradient, the column sum
of dh, from those sums (sum(xhat) too) instead of a third pass over dh. Inductor's
decomposition of BatchNorm's backward reads y for the mask in both passes and sums dh again
for the bias: eight passes over [B, N] against these five.

Each pass's ReLU mask is its own expression, bit-identical to the others (`+` commutes
exactly, `a - (-b)` is `a + b`): a pointwise node with more than `realize_reads_threshold`
inputs that two kernels read is stored by Inductor instead of recomputed in each.

Knows nothing of FX. `reference` is the eager composition the tests compare against.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _LinearBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, bias, weight, beta, running_mean, running_var, momentum: float, eps: float, relu: bool):
        hf = h.float()
        var, mean = torch.var_mean(hf, dim=0, correction=0)
        rstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            rows = h.shape[0]
            batch_mean = mean if bias is None else mean + bias.float()
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(batch_mean.to(running_mean.dtype), alpha=momentum)
                running_var.mul_(1 - momentum).add_((var * (rows / (rows - 1))).to(running_var.dtype),
                                                    alpha=momentum)
        pre = (hf - mean) * rstd * weight.float() + beta.float()
        ctx.save_for_backward(h, mean, rstd, weight, beta)
        ctx.relu, ctx.has_bias = relu, bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return (torch.relu(pre) if relu else pre).to(h.dtype)

    @staticmethod
    def backward(ctx, dy):
        h, mean, rstd, weight, beta = ctx.saved_tensors
        rows = h.shape[0]
        w, b = weight.float(), beta.float()
        xhat = (h.float() - mean) * rstd
        xw = xhat * w
        g = dy.float()
        zero = torch.zeros((), dtype=torch.float32, device=h.device)
        if ctx.relu:  # masks as threshold_backward's: a NaN pre-activation passes dy
            sum_g = torch.where(xw + b <= 0, zero, g).sum(0)
            sum_gx = torch.where(b + xw <= 0, zero, g * xhat).sum(0)
        else:
            sum_g, sum_gx = g.sum(0), (g * xhat).sum(0)
        k = w * rstd
        scaled = g * k
        if ctx.relu:
            scaled = torch.where(xw - (-b) <= 0, zero, scaled)
        mean_term, x_term = k * (sum_g / rows), k * (sum_gx / rows)
        dh = scaled - mean_term - xhat * x_term
        dbias = None
        if ctx.has_bias:  # sum over rows of dh, term by term
            dbias = (k * sum_g - rows * mean_term - xhat.sum(0) * x_term).to(ctx.bias_dtype)
        return (dh.to(h.dtype), dbias, sum_gx.to(weight.dtype), sum_g.to(beta.dtype),
                None, None, None, None, None)


def linear_batch_norm(h: torch.Tensor, bias: Optional[torch.Tensor], weight: torch.Tensor, beta: torch.Tensor,
                      running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor],
                      momentum: float, eps: float, relu: bool) -> torch.Tensor:
    """relu(batch_norm(h + bias)) in training (module docstring); h [B, N], B >= 2."""
    if h.dim() != 2 or h.shape[0] < 2:
        raise ValueError(f"linear_batch_norm: h must be [B, N] with B >= 2, got {tuple(h.shape)}")
    if (running_mean is None) != (running_var is None):
        raise ValueError("linear_batch_norm: running_mean and running_var come together")
    return _LinearBatchNorm.apply(h, bias, weight, beta, running_mean, running_var, momentum, eps, relu)


def reference(h: torch.Tensor, bias: Optional[torch.Tensor], weight: torch.Tensor, beta: torch.Tensor,
              running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor],
              momentum: float, eps: float, relu: bool) -> torch.Tensor:
    """The eager composition `linear_batch_norm` replaces."""
    z = h if bias is None else h + bias.to(h.dtype)
    y = F.batch_norm(z, running_mean, running_var, weight, beta, True, momentum, eps)
    return F.relu(y) if relu else y
