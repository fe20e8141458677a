"""Short English prompts shared by the engine tests that compare greedy outputs of the default model."""

PROMPT_TEXTS = [
    "The French Revolution began in 1789 when",
    "In mathematics, a prime number is a natural number greater than one that",
    "Once upon a time in a small village by the sea, there lived an old fisherman who",
    "The mitochondria is known as the powerhouse of the cell because",
    "To bake a simple loaf of bread you need flour, water, salt and yeast. First,",
    "Python is a programming language that",
]
