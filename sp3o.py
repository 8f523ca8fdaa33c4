"""SP3O: PPO with sparse critic supervision at anchor positions (arXiv 2609.18708, code Dodojordi/SP3O).

(Work in progress: the trainer is being built; `anchor_positions` below is final.)
"""


def anchor_positions(n_valid, ratios=(0.3, 0.6, 0.9), tail_ratio=0.95, tail_min_len=6144):
    """Anchor offsets among the n valid response tokens (the released rule, METHODS.md).

    L = n - 1; each ratio r gives round(L * r) (Python round: half to even), clamped to [0, L] and
    capped at L - 1 so a non-terminal ratio never picks the last token (for n = 1 the cap is 0: the
    only token). If n >= tail_min_len, one more anchor at round(L * tail_ratio) with no cap.
    Colliding anchors merge; an empty response has none. Released tests: n=11 -> [3, 6, 9]; n=2 -> [0].
    """
    if n_valid <= 0:
        return []
    last = n_valid - 1
    cap = max(last - 1, 0)
    offsets = {min(max(round(last * ratio), 0), last, cap) for ratio in ratios}
    if tail_ratio is not None and n_valid >= tail_min_len:
        offsets.add(min(max(round(last * tail_ratio), 0), last))
    return sorted(offsets)
