"""Delta refits: P2P messages that carry only what changed since the version the receiver holds.

One module per idea, from the bytes up to the run (import each from its module):

* ``wire``: the encodings (dense, sparse, bitmask, words) and the byte layout of a piece in each.
* ``rule``: the cost rule, when a delta pays and which encoding a message takes, on measured link rates.
* ``elements``: per-element find, apply and index check (torch; the one-pass Triton find where it runs).
* ``words``: per 64-bit word find, pack, check and scatter, many pieces per launch (and the torch reference).
* ``kernels``: the Triton kernels both call.
* ``chunks``: what every process derives alike from the plan: step-chunks, shares, links, whether it pays.
* ``header``: the per-message header, the quiet-refit trailer and the held-version exchange, checked.
* ``ops``: one P2P message in delta mode and the setup facts kept per list of them; a run's stats.
* ``base``: a source's copy of what it last sent (the base its next deltas diff against).
* ``send``: the sender's plan, find, choice and encoding per message.
* ``payload``: a step-chunk's payloads to one peer joined in one buffer; words packed by address.
* ``receive``: the receiver's header checks, index checks and apply.
* ``schedule``: ``DeltaSchedule``, the run of one process's P2P steps in delta mode (the executor's entry).
"""
