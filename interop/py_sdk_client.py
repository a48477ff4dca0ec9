"""One WuKongIM Python EasySDK client (wukong-easy-sdk, JSON-RPC over WebSocket),
driven line by line: the Rust test writes JSON commands on stdin and reads JSON events
on stdout.

env: WS_ADDR (ws://127.0.0.1:PORT), UID, TOKEN, DEVICE_FLAG (default 1 = WEB)
commands: {"cmd":"send","channel_id":"u2","channel_type":1,"payload":{...}},
          {"cmd":"reconnect"} (disconnect, then connect again), {"cmd":"exit"}
events:   {"event":"connected","result":{...}}, {"event":"connect_failed","code":2},
          {"event":"sendack","messageId":"...","messageSeq":1,"reasonCode":1},
          {"event":"send_failed","code":22},
          {"event":"message","from":"u1","channel_id":"u1","channel_type":1,
           "payload":{...},"message_id":"...","message_seq":1},
          {"event":"disconnect","reasonCode":-5}, {"event":"error","code":-5}
"""

import asyncio
import json
import os
import sys

from wukong_easy_sdk import WKIM, AuthOptions, WKIMError, WKIMEvent, WKIMOptions


def out(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def on_message(m):
    out(
        {
            "event": "message",
            "from": m["fromUid"],
            "channel_id": m["channelId"],
            "channel_type": m["channelType"],
            "payload": m["payload"],
            "message_id": m["messageId"],
            "message_seq": m["messageSeq"],
        }
    )


async def connect(client):
    try:
        out({"event": "connected", "result": await client.connect()})
        return True
    except WKIMError as e:
        out({"event": "connect_failed", "code": e.code})
        return False


async def main():
    auth = AuthOptions(
        uid=os.environ["UID"],
        token=os.environ["TOKEN"],
        device_id=os.environ["UID"] + "-py",
        device_flag=int(os.environ.get("DEVICE_FLAG", "1")),
    )
    client = WKIM(os.environ["WS_ADDR"], auth, WKIMOptions(max_reconnect_attempts=0))
    client.on(WKIMEvent.MESSAGE, on_message)
    client.on(WKIMEvent.DISCONNECT, lambda d: out({"event": "disconnect", **d}))
    client.on(WKIMEvent.ERROR, lambda e: out({"event": "error", "code": e.code}))
    await connect(client)
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        cmd = json.loads(line)
        if cmd["cmd"] == "send":
            try:
                ack = await client.send(cmd["channel_id"], cmd["channel_type"], cmd["payload"])
                out({"event": "sendack", **ack})
            except WKIMError as e:
                out({"event": "send_failed", "code": e.code})
        elif cmd["cmd"] == "reconnect":
            await client.disconnect()
            await connect(client)
        elif cmd["cmd"] == "exit":
            break
    await client.destroy()


asyncio.run(main())
