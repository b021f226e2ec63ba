"""Draft trees: their host and device layouts, their growth and their verification."""
