"""Whether a method that renders its own token ids (lev's) runs rows about one prefix over one
prefill of it or each as a whole row: whichever computes fewer tokens, counting the prefill's
own forward as FORWARD_TOKENS more. SemIf's shared path always prefills its state (the contract).

Measured in process (bench/sharing.py, bench geometry, bf16, one thread; two runs agree on the
winner): two rows over a 20-token prefix with 44-token suffixes cost 138 ms whole, 175 ms
shared; over 50 tokens 224 vs 185 ms; eight rows over 20 tokens 424 vs 371 ms.
"""

from __future__ import annotations

FORWARD_TOKENS = 48  # one more forward's fixed cost, in tokens of work (about 50 ms at ~1 ms/token)


def prefill_pays(prefix_tokens: int, to_prefill: int, rows: int, width: int) -> bool:
    """Whether `rows` rows (suffixes up to `width` tokens, right-padded) over a
    `prefix_tokens`-token prefix cost less over one prefill of it (`to_prefill`: the tokens
    still to prefill past a cached state, 0 when it is cached) than as whole right-padded rows;
    a tie goes to the prefix (a cached one is then a hit)."""
    whole = rows * (prefix_tokens + width)
    shared = (to_prefill + FORWARD_TOKENS if to_prefill else 0) + rows * width
    return shared <= whole
