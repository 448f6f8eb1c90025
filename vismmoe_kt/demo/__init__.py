"""The trained demo model's world: a seeded synthetic visual QA task (`vqa`) and the shipped weights."""
