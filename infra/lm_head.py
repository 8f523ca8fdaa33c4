"""The LM head and log-softmax a slice of the vocabulary at a time, forward and backward, behind
common.head_logprobs: no [N, V] logits tensor exists in either pass (the idea of Liger's fused linear
cross-entropy). Pinned against whole logits, values and gradients, in tests/test_logprobs.py.
"""
import torch


def head_slices(hidden, weight, dtype, columns, temperature):
    """(first column, the slice's [V_s, d] weight in `dtype`, its [N, V_s] logits / temperature in float32) for
    each slice of `columns` vocabulary rows."""
    for start in range(0, weight.shape[0], columns):
        part = weight[start:start + columns].to(dtype)
        logits = (hidden @ part.T).float()
        yield start, part, logits if temperature == 1 else logits.div_(temperature)


class SlicedHeadLogprobs(torch.autograd.Function):
    """log p_y = z_y / tau - logsumexp(z / tau) with z = h W^T for [N, d] h, [V, d] W and [N] tokens y, one
    vocabulary slice of `columns` rows at a time: the logsumexp accumulates over slices. Saved for backward: h, W
    (not copies) and one logsumexp per position. Backward recomputes each slice's z: dz_j = (1[j = y] - p_j) g / tau,
    then dh += dz W_slice and dW_slice = dz^T h (each row of W written once). A tied W gets this gradient beside the
    embedding's (autograd adds them)."""

    @staticmethod
    def forward(ctx, hidden, weight, tokens, temperature, dtype, columns):
        compute = hidden.to(dtype)
        logsumexp = torch.full(tokens.shape, -torch.inf, device=hidden.device)
        target, rows = torch.zeros_like(logsumexp), torch.arange(len(tokens), device=tokens.device)
        for start, _, logits in head_slices(compute, weight, dtype, columns, temperature):
            logsumexp = torch.logaddexp(logsumexp, logits.logsumexp(-1))
            inside = (tokens >= start) & (tokens < start + logits.shape[1])
            target[inside] = logits[rows[inside], tokens[inside] - start]
        ctx.save_for_backward(hidden, weight, tokens, logsumexp)
        ctx.temperature, ctx.dtype, ctx.columns = temperature, dtype, columns
        return target - logsumexp

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, tokens, logsumexp = ctx.saved_tensors
        compute, scale = hidden.to(ctx.dtype), grad_out.float() / ctx.temperature
        grad_hidden = torch.zeros(hidden.shape, device=hidden.device)  # float32: the slices' sum
        grad_weight = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        rows = torch.arange(len(tokens), device=tokens.device)
        for start, part, logits in head_slices(compute, weight, ctx.dtype, ctx.columns, ctx.temperature):
            grad = logits.sub_(logsumexp[:, None]).exp_().mul_(-scale[:, None])  # -p g / tau, in place
            inside = (tokens >= start) & (tokens < start + logits.shape[1])
            grad[rows[inside], tokens[inside] - start] += scale[inside]
            grad = grad.to(ctx.dtype)
            grad_hidden += grad @ part
            if grad_weight is not None:
                grad_weight[start:start + len(part)] = grad.T @ compute
        return grad_hidden.to(hidden.dtype), grad_weight, None, None, None, None
