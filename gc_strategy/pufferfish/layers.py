"""Low-rank ("factorised") layers of Pufferfish (Wang, Agarwal, Papailiopoulos, MLSys 2021, §3).

A weight ``W`` (``m × n`` once reshaped to a matrix) is replaced by the product ``U V`` of an
``m × r`` and an ``r × n`` factor; the layer applies ``V`` first and ``U`` second, so it costs
``r (m + n)`` parameters and multiply-adds per output position instead of ``m n``.
``from_full(layer, rank, copy_weights=False)`` builds the structure only (for loading saved
factors). Converting a trained layer uses the truncated SVD ``W = Σ σ_i u_i v_iᵀ``:
``U = U_r √S_r`` and ``V = √S_r V_rᵀ``, the best rank-``r`` approximation of ``W`` in Frobenius
and spectral norm (Eckart–Young); at ``r = min(m, n)`` the product is ``W`` itself.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def svd_factors(matrix: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """``(U_r √S_r, √S_r V_rᵀ)`` of ``matrix`` (computed in at least fp32, returned in its dtype)."""
    work = matrix.detach().to(torch.promote_types(matrix.dtype, torch.float32))
    u, s, vh = torch.linalg.svd(work, full_matrices=False)
    root = s[:rank].sqrt()
    return (u[:, :rank] * root).to(matrix.dtype), (root[:, None] * vh[:rank]).to(matrix.dtype)


def _load_factors(u: nn.Module, v: nn.Module, matrix: Tensor, rank: int) -> None:
    """Set ``u.weight`` and ``v.weight`` (any shapes holding ``m×r`` and ``r×n`` elements) from the SVD."""
    left, right = svd_factors(matrix, rank)
    with torch.no_grad():
        u.weight.copy_(left.reshape(u.weight.shape))
        v.weight.copy_(right.reshape(v.weight.shape))


def _copy_bias(target: nn.Module, bias: Tensor | None) -> None:
    if bias is not None:
        with torch.no_grad():
            target.bias.copy_(bias)


class LowRankLinear(nn.Module):
    """``y = U (V x) + b``: a ``d_in → r`` linear without bias, then ``r → d_out`` with the bias."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        bias: bool = True,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.rank = rank
        self.v = nn.Linear(in_features, rank, bias=False, device=device, dtype=dtype)
        self.u = nn.Linear(rank, out_features, bias=bias, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.u(self.v(x))

    @classmethod
    def from_full(cls, linear: nn.Linear, rank: int, copy_weights: bool = True) -> LowRankLinear:
        layer = cls(
            linear.in_features,
            linear.out_features,
            rank,
            linear.bias is not None,
            linear.weight.device,
            linear.weight.dtype,
        )
        if copy_weights:
            _load_factors(layer.u, layer.v, linear.weight, rank)
            _copy_bias(layer.u, linear.bias)
        return layer


class LowRankConv2d(nn.Module):
    """A ``k×k`` convolution ``c_in → r`` (stride, padding and dilation of the original, no bias),
    then a ``1×1`` convolution ``r → c_out`` with the original bias. The matrix is the weight
    reshaped to ``c_out × (c_in·k_h·k_w)``."""

    def __init__(self, conv: nn.Conv2d, rank: int) -> None:
        super().__init__()
        if conv.groups != 1:
            raise ValueError(f"a grouped convolution (groups={conv.groups}) is not one matrix; keep it full-rank")
        self.rank = rank
        w = conv.weight
        self.v = nn.Conv2d(
            conv.in_channels,
            rank,
            conv.kernel_size,
            conv.stride,
            conv.padding,
            conv.dilation,
            bias=False,
            padding_mode=conv.padding_mode,
            device=w.device,
            dtype=w.dtype,
        )
        self.u = nn.Conv2d(rank, conv.out_channels, 1, bias=conv.bias is not None, device=w.device, dtype=w.dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.u(self.v(x))

    @classmethod
    def from_full(cls, conv: nn.Conv2d, rank: int, copy_weights: bool = True) -> LowRankConv2d:
        layer = cls(conv, rank)
        if copy_weights:
            _load_factors(layer.u, layer.v, conv.weight.reshape(conv.out_channels, -1), rank)
            _copy_bias(layer.u, conv.bias)
        return layer


class LowRankLSTM(nn.Module):
    """Unidirectional multi-layer LSTM (``nn.LSTM``'s interface, gate order i, f, g, o) whose
    input-to-hidden and hidden-to-hidden matrices of every layer are :class:`LowRankLinear` pairs:

        gates_t = U_ih (V_ih x_t) + b_ih + U_hh (V_hh h_{t-1}) + b_hh
        c_t = σ(f) ⊙ c_{t-1} + σ(i) ⊙ tanh(g),   h_t = σ(o) ⊙ tanh(c_t)

    The input projections of all time steps run as one batched product; the recurrence is a loop.
    ``ranks[l] = (r_ih, r_hh)`` per layer.
    """

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int,
        ranks: list[tuple[int, int]],
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if len(ranks) != num_layers:
            raise ValueError(f"LowRankLSTM needs one (r_ih, r_hh) pair per layer: {num_layers} layers, got {ranks}")
        self.hidden_size, self.num_layers = hidden_size, num_layers
        self.batch_first, self.dropout = batch_first, dropout
        gates = 4 * hidden_size
        self.ih = nn.ModuleList(
            LowRankLinear(input_size if layer == 0 else hidden_size, gates, r_ih, bias, device, dtype)
            for layer, (r_ih, _) in enumerate(ranks)
        )
        self.hh = nn.ModuleList(LowRankLinear(hidden_size, gates, r_hh, bias, device, dtype) for _, r_hh in ranks)

    def forward(self, x: Tensor, hx: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        if x.dim() != 3:
            raise ValueError(f"LowRankLSTM expects a batched 3-D input, got shape {tuple(x.shape)}")
        if not self.batch_first:
            x = x.transpose(0, 1)
        if hx is None:
            zeros = x.new_zeros(self.num_layers, x.shape[0], self.hidden_size)
            hx = (zeros, zeros)
        last_h, last_c = [], []
        for layer in range(self.num_layers):
            if layer > 0 and self.dropout > 0:
                x = nn.functional.dropout(x, self.dropout, self.training)
            input_gates = self.ih[layer](x)
            h, c = hx[0][layer], hx[1][layer]
            outputs = []
            for t in range(x.shape[1]):
                i, f, g, o = (input_gates[:, t] + self.hh[layer](h)).chunk(4, dim=1)
                c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h = torch.sigmoid(o) * torch.tanh(c)
                outputs.append(h)
            x = torch.stack(outputs, dim=1)
            last_h.append(h)
            last_c.append(c)
        output = x if self.batch_first else x.transpose(0, 1)
        return output, (torch.stack(last_h), torch.stack(last_c))

    @classmethod
    def from_full(cls, lstm: nn.LSTM, ranks: list[tuple[int, int]], copy_weights: bool = True) -> LowRankLSTM:
        if lstm.bidirectional or lstm.proj_size:
            raise ValueError("only unidirectional LSTMs without projections can be factorised; keep this one full-rank")
        w = lstm.weight_ih_l0
        layer = cls(
            lstm.input_size,
            lstm.hidden_size,
            lstm.num_layers,
            ranks,
            lstm.bias,
            lstm.batch_first,
            lstm.dropout,
            w.device,
            w.dtype,
        )
        for index, (r_ih, r_hh) in enumerate(ranks if copy_weights else []):
            for pair, kind, rank in ((layer.ih[index], "ih", r_ih), (layer.hh[index], "hh", r_hh)):
                _load_factors(pair.u, pair.v, getattr(lstm, f"weight_{kind}_l{index}"), rank)
                _copy_bias(pair.u, getattr(lstm, f"bias_{kind}_l{index}", None))
        return layer


LOW_RANK_LAYERS = (LowRankLinear, LowRankConv2d, LowRankLSTM)
