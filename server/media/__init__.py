"""Image input: fetching and decoding the images of a request (``server/media/fetch.py``)
and turning them into what the engine reads (``server/media/process.py``)."""
