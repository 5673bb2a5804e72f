"""Environments: recipes, the builder, and the base / workspace / toolkit roles."""
from .builder import DEFAULT_EXCLUDE, Builder, BuildResult
from .recipe import Recipe, Step, load_recipe, parse_recipe

__all__ = ["Builder", "BuildResult", "DEFAULT_EXCLUDE", "Recipe", "Step", "load_recipe", "parse_recipe"]
