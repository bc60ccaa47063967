"""The shared KV-block budget: one semantics (:mod:`.ledger`), two backends (:mod:`.local`, :mod:`.redis`)."""
