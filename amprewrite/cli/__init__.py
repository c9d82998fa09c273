"""``python -m amprewrite``: the commands (``main``: demo, explain, audit; ``precision``:
compare, search, memory), what they share (``common``) and the demo's model (``demo``)."""
