"""Result rows: their column contract (schema), how they reach disk and come back."""
