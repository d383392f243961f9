"""The data plane: HTTP/1.1 on asyncio protocols with llhttp (httptools) parsing.

Work in progress (issue 11): not yet used by the proxy listener. See the notes below.
"""
