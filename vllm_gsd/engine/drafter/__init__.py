"""The GSD drafter's jobs, one module each; engine/proposer.py's GsdProposer runs them in order.

    batch.py             what the drafter reads of the runner's batch in a step, as arrays
    adaptive.py          the adaptive budget's feed: the step's record, measured times, decision
    feedback.py          what verified trees teach: acceptance calibration, lookup odds
    choose.py            the requests that grow a tree, and where each one's draft KV is valid
    catch_up.py          the draft's causal forwards over the tokens it has not seen
    forward_metadata.py  one draft forward's inputs and attention metadata
    grow.py              the hypothesis graph level by level, and the tree to verify
    children.py          the LM head and each row's children
"""
