"""Tool calls: parsing them out of generated text, and the grammar that forces them."""
