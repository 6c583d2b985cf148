"""The one error of fetching and decoding media.

Its message is written for the client and is the whole of what it sees (the server's 400): it
names the problem and at most the URL's own host name, never a resolved address, a decoder's
own words, a path outside what the client sent, or an object's `0x...` address.
"""

from __future__ import annotations

from metrale.messages.errors import InvalidRequestError


class MediaError(InvalidRequestError):
    pass
