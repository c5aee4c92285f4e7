"""The package, its extras, its imports, the README and the setup step."""
