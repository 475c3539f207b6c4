"""roundalign.rl: a GRPO experiment harness (``roundalign train``, ``roundalign compare``) on the reference engine.

It reproduces, at small scale, the two rounding effects roundalign exists for: a trainer that rounds where the
engine does stays on-policy (Ke, Cai, Wang), and a weight export that rounds stochastically or with error feedback
lets the sampler see updates that round-to-nearest hides (Gao & Gao, ``roundalign.sync``). docs/train.md.
"""
