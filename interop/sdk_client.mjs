// One WuKongIM JS SDK client, driven line by line: the Rust test writes JSON commands
// on stdin and reads JSON events on stdout. (The SDK is a per-process singleton, so
// each client is its own process.)
//
// env: WS_ADDR (ws://127.0.0.1:PORT), UID, TOKEN, DEVICE_FLAG (default 1 = WEB)
// commands: {"cmd":"send","channel_id":"u2","channel_type":1,"text":"hi"}, {"cmd":"exit"}
// events:   {"event":"status","status":1,"reason":0}, {"event":"sendack",...},
//           {"event":"message","from":"u1","channel_id":"u1","channel_type":1,"text":"hi","seq":1}
import readline from 'node:readline';

globalThis.WebSocket = (await import('ws')).default;
const { default: WKSDK } = await import('wukongimjssdk');
const { Channel, MessageText } = await import('wukongimjssdk/lib/model.js');

const out = (obj) => process.stdout.write(JSON.stringify(obj) + '\n');

const sdk = WKSDK.shared();
sdk.config.addr = process.env.WS_ADDR;
sdk.config.uid = process.env.UID;
sdk.config.token = process.env.TOKEN;
sdk.config.deviceFlag = Number(process.env.DEVICE_FLAG ?? 1);

sdk.connectManager.addConnectStatusListener((status, reason) => {
  out({ event: 'status', status, reason: reason ?? 0 });
});
sdk.chatManager.addMessageListener((m) => {
  out({
    event: 'message',
    from: m.fromUID,
    channel_id: m.channel.channelID,
    channel_type: m.channel.channelType,
    text: m.content?.text ?? null,
    seq: m.messageSeq,
  });
});
sdk.chatManager.addMessageStatusListener((ack) => {
  out({ event: 'sendack', client_seq: ack.clientSeq, reason: ack.reasonCode });
});

const rl = readline.createInterface({ input: process.stdin });
rl.on('line', async (line) => {
  const cmd = JSON.parse(line);
  if (cmd.cmd === 'send') {
    await sdk.chatManager.send(new MessageText(cmd.text), new Channel(cmd.channel_id, cmd.channel_type));
  } else if (cmd.cmd === 'exit') {
    process.exit(0);
  }
});
rl.on('close', () => process.exit(0));

sdk.connect();
