"""Decoding: one verifier session and one loop for plain, chain and tree decoding at any batch size, the acceptance
rules, and the drafters (prompt lookup, datastore, EAGLE-3, the hybrid). Above ``models/``, below ``data/``
(regeneration), ``train/`` and ``eval/``, which all decode through it (docs/design.md, "Decoding")."""
