"""Package data: the IN-9 class list and the ImageNet->IN-9 map, loaded relative to this package."""
