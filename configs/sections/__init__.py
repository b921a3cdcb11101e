"""One module per RunConfig section (configs/schema.py holds RunConfig and re-exports every class)."""
