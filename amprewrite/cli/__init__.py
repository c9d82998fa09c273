"""``python -m amprewrite``: the commands (``main``: demo, explain, audit; ``precision``:
compare, search, memory), their arguments and examples, parsed before torch is
imported (``parser``), what they share (``common``) the demo's model (``demo``) and its side-by-side measurement against ``torch.autocast``
(``measure``)."""
