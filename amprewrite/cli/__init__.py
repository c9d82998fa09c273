"""``python -m amprewrite``: the commands (``main``: demo, explain, audit; ``precision``:
compare, search, memory), what they share (``common``) the demo's model (``demo``) and its side-by-side measurement against ``torch.autocast``
(``measure``)."""
