"""The typed bodies the actors send each other, in one place: the checks they share and
``MalformedReply`` (``checks``), one module per conversation (``gateway``: gateway to scheduler;
``verifier``, ``speculator``, ``length``: the scheduler with each), and the packed trees and
sampling parameters several of them carry (``tree_wire``)."""
