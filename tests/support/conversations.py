"""A few short chat conversations, for tests that write a prompt file of their own."""

CONVERSATIONS = [
    [{"role": "user", "content": "Write a stack class."},
     {"role": "assistant", "content": "class Stack:\n    def __init__(self):\n        self.items = []\n"}],
    [{"role": "user", "content": "Add a push method: def push(self, x)."},
     {"role": "assistant", "content": "    def push(self, x):\n        self.items.append(x)\n"}],
] + [
    [{"role": "user", "content": f"Print the square of {i}."}, {"role": "assistant", "content": f"print({i} * {i})"}]
    for i in range(6)
]
