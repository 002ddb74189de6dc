"""``onegpu tradeoffs``: the single-GPU guide's table, measured on the user's own model and data.

One module per concern (this package imports none of them, so ``onegpu --help`` reads
:data:`onegpu.tradeoffs.knobs.KNOBS` at once):

* :mod:`.knobs`: the plan, one small function per knob of the guide (``KNOBS``);
* :mod:`.queue`: the DVC queue driver (queue, run one at a time, wait);
* :mod:`.batch`: one batch: its kept plan, starting it, measuring its runs, running the combination;
* :mod:`.measurement`: each variant's run against the baseline (steady samples/s, memory, verdict);
* :mod:`.recommend`: the fastest same-training configuration within the memory budget;
* :mod:`.report`: ``tradeoffs.md``, ``tradeoffs.png`` and the terminal table.
"""
