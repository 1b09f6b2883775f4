#!/usr/bin/python3
"""Where the default policy's kernel and captured limits sit (src/verdict/policy.cpp): a synthetic
simulation of clean kernels and of the bugs the limits must catch.

For Gaussian q (bf16) and KV (bf16 source, quantized per tensor to e4m3 with kv_scale =
max|x| / 448), it computes in binary64 the exact attention on the dequantized pool (R8) and on
the source (Rs), then candidates that round where kernels round:

  kernel       fp32 scores, P rounded to bf16, output rounded to bf16 (kernels/mla_attention_model.hpp)
  capt_bf16kv  as kernel, but K and V are bf16(code * kv_scale) (a server kernel that scales
               before a bf16 MMA)
  e4m3P        bug: P rounded to e4m3 instead of bf16
  pow2scale    bug: the pool read with kv_scale rounded to the nearest power of two
  quant        R8 against Rs (what FP8 storage costs)

and prints rel_l2, cos_diff, max_abs / max|ref| and max |lse error| per case, for softmaxes from
diffuse (|s| <= 8) to sharp (|s| ~ 100). Run: /usr/bin/python3 docs/policy_calibration.py
"""
import numpy as np

RNG = np.random.default_rng(1)
DC, DR, HEADS, ROWS = 512, 64, 16, 4
# 192^-0.5 (DeepSeek-V3's qk_head_dim without YaRN's mscale^2; GLM-5's is 1/16): only a unit here,
# each case's score_factor sets how sharp its softmax is (the |s| printed), which is what the
# limits depend on; the numbers quoted in src/verdict/policy.cpp were printed with this value.
SM_SCALE = 1 / np.sqrt(192)


def bf16(x):
    """Round to bf16, nearest even (through float32; inputs here are float32-exact or near)."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32).astype(np.float64)


def e4m3(x):
    """Round to e4m3fn, nearest even, saturating at 448 (quantum 2^(e-3), 2^-9 below 2^-6)."""
    x = np.asarray(x, dtype=np.float64)
    exponent = np.maximum(np.floor(np.log2(np.maximum(np.abs(x), 1e-300))), -6)
    quantum = 2.0 ** (exponent - 3)
    return np.sign(x) * np.minimum(np.round(np.abs(x) / quantum) * quantum, 448.0)


def attention(q, kv, p_round=None, score_factor=1.0, value_factor=1.0, fp32=False, out_bf16=True):
    if fp32:
        s = np.einsum('rhd,td->rht', q.astype(np.float32), kv.astype(np.float32))
        s = (s * np.float32(SM_SCALE * score_factor)).astype(np.float64)
    else:
        s = SM_SCALE * score_factor * np.einsum('rhd,td->rht', q, kv)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    l = p.sum(-1, keepdims=True)
    weights = p if p_round is None else p_round(p)
    out = np.einsum('rht,tc->rhc', weights, kv[:, :DC] * value_factor) / l
    return (bf16(out) if out_bf16 else out), (m + np.log(l))[..., 0]


def metrics(ref, cand):
    (a, lse_a), (b, lse_b) = ref, cand
    d = a - b
    return (np.sqrt((d ** 2).sum() / (a ** 2).sum()), (d ** 2).sum() / (a ** 2 + b ** 2).sum(),
            np.abs(d).max() / np.abs(a).max(), np.abs(lse_a - lse_b).max())


def run(q_scale, tokens):
    source = bf16(RNG.standard_normal((tokens, DC + DR)))
    kv_scale = float(np.float32(np.abs(source).max() / 448.0))
    pool = e4m3(source / kv_scale) * kv_scale
    q = bf16(RNG.standard_normal((ROWS, HEADS, DC + DR)) * q_scale)
    pow2 = 2.0 ** np.round(np.log2(kv_scale)) / kv_scale
    r8 = attention(q, pool, out_bf16=False)
    cases = {
        'kernel': (r8, attention(q, pool, p_round=bf16, fp32=True)),
        'capt_bf16kv': (r8, attention(q, bf16(pool), p_round=bf16, fp32=True)),
        'e4m3P': (r8, attention(q, pool, p_round=e4m3, fp32=True)),
        'pow2scale': (r8, attention(q, pool, p_round=bf16, score_factor=pow2, value_factor=pow2)),
        'quant': (attention(q, source, out_bf16=False), r8),
    }
    s_max = np.abs(SM_SCALE * np.einsum('rhd,td->rht', q, pool)).max()
    print(f'|s| <= {s_max:5.1f}, {tokens} tokens (power-of-two scale factor {pow2:.3f})')
    for name, (ref, cand) in cases.items():
        rel_l2, cos_diff, over_max, lse = metrics(ref, cand)
        print(f'  {name:12s} rel_l2 2^{np.log2(rel_l2):5.1f}  cos_diff {cos_diff:.2e}  '
              f'max_abs/ref_max {over_max:.2e}  lse {lse:.2e}')


if __name__ == '__main__':
    for q_scale, tokens in [(1, 1024), (3, 1024), (8, 1024), (3, 4096), (8, 256), (16, 256)]:
        run(q_scale, tokens)
