"""Decoding: the one generation loop (:mod:`.loop`), the chain and tree round
modes it plugs in (:mod:`.modes`), and lossless verification (:mod:`.verify`)."""
