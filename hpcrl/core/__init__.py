"""The ground: value checks (``checks``) and the record of the parallel degrees (``parallel``). Imports
nothing of hpcrl but ``errors``; every other folder may import it."""
