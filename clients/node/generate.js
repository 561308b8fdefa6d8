#!/usr/bin/env node
// Streams a completion from specdec's CoordinatorService.GenerateStream.
//
//   node clients/node/generate.js --address HOST:PORT [--max-new-tokens N] [--temperature T]
//       [--seed S] [--draft-length G] [--timeout SECONDS] [--token-ids 1,2,3]
//       [--api-token TOKEN] [--tls] [--tls-ca PEM] [--tls-cert PEM --tls-key PEM]
//       [--tls-server-name NAME] ["PROMPT"]
//
// The API token (default: $SPECDEC_API_TOKEN) goes as `authorization: Bearer TOKEN` metadata;
// any --tls* flag turns TLS on (--tls alone trusts the system's CAs).
//
// The text goes to stdout as it streams; at the end one JSON line goes to stderr:
//   {"token_ids": [...], "finish_reason": "FINISH_REASON_LENGTH", "stats": {...}}
// with the stats' fields named as in protos/specdec.proto. On a gRPC error it prints
// "STATUS_NAME: details" to stderr and exits 1; on bad usage it exits 2.
'use strict';

const fs = require('fs');
const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO = path.resolve(__dirname, '..', '..', 'protos', 'specdec.proto');

const USAGE = `usage: node generate.js --address HOST:PORT [--max-new-tokens N] [--temperature T]
                   [--seed S] [--draft-length G] [--timeout SECONDS] [--token-ids 1,2,3]
                   [--api-token TOKEN] [--tls] [--tls-ca PEM] [--tls-cert PEM --tls-key PEM]
                   [--tls-server-name NAME] ["PROMPT"]

Calls specdec.v1.CoordinatorService/GenerateStream and prints the text to stdout as it streams,
then one JSON line {"token_ids", "finish_reason", "stats"} to stderr.
A prompt is either --token-ids (comma-separated ids in the target's vocabulary) or PROMPT text.
--api-token (default: $SPECDEC_API_TOKEN) is sent as \`authorization: Bearer TOKEN\` metadata.
--tls-ca: the CA that signed the coordinator's certificate; --tls-cert/--tls-key: a client
certificate (mutual TLS); --tls-server-name: the name to expect in the server's certificate;
--tls: TLS trusting the system's CAs. Any of them turns TLS on.`;

class UsageError extends Error {}

const VALUE_FLAGS = new Set([
  'address', 'max-new-tokens', 'temperature', 'seed', 'draft-length', 'token-ids', 'timeout',
  'api-token', 'tls-ca', 'tls-cert', 'tls-key', 'tls-server-name',
]);
const BOOLEAN_FLAGS = new Set(['tls']);
const TOKEN_ENV = 'SPECDEC_API_TOKEN';

// grpc-js names the server in the TLS handshake even when it is an IP address (127.0.0.1), which
// Node answers with a deprecation warning on every run (DEP0123); the certificate is still checked
// against the IP. Keep stderr to the output this client promises; print any other warning as Node would.
process.removeAllListeners('warning');
process.on('warning', (warning) => {
  if (warning.code !== 'DEP0123') process.stderr.write(`(node) ${warning.name}: ${warning.message}\n`);
});

function parseArgs(argv) {
  const opts = {};
  const positional = [];
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    if (arg === '-h' || arg === '--help') {
      opts.help = true;
    } else if (arg === '--') {
      positional.push(...argv.slice(i + 1));
      break;
    } else if (arg.startsWith('--')) {
      const eq = arg.indexOf('=');
      const name = eq >= 0 ? arg.slice(2, eq) : arg.slice(2);
      if (BOOLEAN_FLAGS.has(name)) {
        if (eq >= 0) throw new UsageError(`--${name} takes no value`);
        opts[name] = true;
        continue;
      }
      if (!VALUE_FLAGS.has(name)) throw new UsageError(`unknown option --${name}`);
      let value;
      if (eq >= 0) {
        value = arg.slice(eq + 1);
      } else {
        if (i + 1 >= argv.length) throw new UsageError(`--${name} needs a value`);
        value = argv[++i]; // taken as is, so "--max-new-tokens -1" works
      }
      opts[name] = value;
    } else {
      positional.push(arg);
    }
  }
  if (positional.length > 1) throw new UsageError('give one PROMPT (quote it)');
  opts.prompt = positional[0];
  return opts;
}

function integer(name, value) {
  if (!/^[+-]?\d+$/.test(value.trim())) throw new UsageError(`--${name} must be an integer, got "${value}"`);
  const n = Number(value);
  if (!Number.isSafeInteger(n)) throw new UsageError(`--${name} is out of range: ${value}`);
  return n;
}

function number(name, value) {
  const n = Number(value);
  if (value.trim() === '' || Number.isNaN(n)) throw new UsageError(`--${name} must be a number, got "${value}"`);
  return n;
}

function buildRequest(opts) {
  const request = {};
  if (opts['token-ids'] !== undefined) {
    if (opts.prompt !== undefined) throw new UsageError('give either --token-ids or PROMPT, not both');
    const text = opts['token-ids'].trim();
    request.token_ids = { ids: text === '' ? [] : text.split(',').map((t) => integer('token-ids', t)) };
  } else if (opts.prompt !== undefined) {
    request.text = opts.prompt;
  } else {
    throw new UsageError('a prompt is required: PROMPT or --token-ids');
  }
  if (opts['max-new-tokens'] !== undefined) request.max_new_tokens = integer('max-new-tokens', opts['max-new-tokens']);
  const sampling = {};
  if (opts.temperature !== undefined) sampling.temperature = number('temperature', opts.temperature);
  if (opts.seed !== undefined) {
    if (!/^\d+$/.test(opts.seed.trim())) throw new UsageError(`--seed must be a non-negative integer, got "${opts.seed}"`);
    sampling.seed = opts.seed.trim(); // a string keeps all 64 bits
  }
  if (Object.keys(sampling).length) request.sampling = sampling;
  if (opts['draft-length'] !== undefined) request.speculation = { draft_length: integer('draft-length', opts['draft-length']) };
  return request;
}

function readPem(flag, file) {
  try {
    return fs.readFileSync(file);
  } catch (err) {
    throw new UsageError(`--${flag}: cannot read "${file}": ${err.code || err.message}`);
  }
}

// How to reach the coordinator: channel credentials and options, and every call's metadata.
function connection(opts) {
  const token = (opts['api-token'] !== undefined ? opts['api-token'] : process.env[TOKEN_ENV] || '').trim();
  if (!/^[\x21-\x7e]*$/.test(token)) {
    throw new UsageError('--api-token: only printable ASCII without spaces can travel in an `authorization` header');
  }
  const metadata = new grpc.Metadata();
  if (token) metadata.set('authorization', `Bearer ${token}`);
  if ((opts['tls-cert'] === undefined) !== (opts['tls-key'] === undefined)) {
    throw new UsageError('--tls-cert and --tls-key go together');
  }
  const tls = Boolean(opts.tls || opts['tls-ca'] || opts['tls-cert'] || opts['tls-server-name']);
  const channelOptions = {};
  let credentials = grpc.credentials.createInsecure();
  if (tls) {
    credentials = grpc.credentials.createSsl(
      opts['tls-ca'] ? readPem('tls-ca', opts['tls-ca']) : null, // null: the system's CAs
      opts['tls-key'] ? readPem('tls-key', opts['tls-key']) : null,
      opts['tls-cert'] ? readPem('tls-cert', opts['tls-cert']) : null,
    );
    if (opts['tls-server-name']) {
      channelOptions['grpc.ssl_target_name_override'] = opts['tls-server-name'];
      channelOptions['grpc.default_authority'] = opts['tls-server-name'];
    }
  }
  return { credentials, channelOptions, metadata, tls, clientCert: Boolean(opts['tls-cert']) };
}

// What to do about a failed call, or '' (the same advice as `specdec generate`).
function hint(code, details, tls, clientCert) {
  if (code === grpc.status.UNAUTHENTICATED) return `the coordinator requires an API token: pass --api-token or set $${TOKEN_ENV}`;
  if (code === grpc.status.PERMISSION_DENIED) return `the coordinator rejected the API token: check --api-token / $${TOKEN_ENV}`;
  if (code !== grpc.status.UNAVAILABLE) return '';
  if (/WRONG_VERSION_NUMBER|wrong version number|packet length too long/i.test(details)) {
    return 'the server does not speak TLS: drop --tls and the --tls-* flags';
  }
  if (/certificate|Hostname|altnames|self.signed/i.test(details)) {
    return 'the server\'s certificate is not trusted or does not name the host: check --tls-ca and --tls-server-name';
  }
  if (/Connection refused|ECONNREFUSED/.test(details)) return 'nothing listens there: start a coordinator or check --address';
  // A server that hangs up during set-up: TLS against plaintext, or a client certificate missing or refused.
  if (!/No connection established|Failed to connect|handshake|socket disconnected/i.test(details)) return '';
  if (clientCert) return 'the TLS connection failed: the server may not accept --tls-cert (not signed by the CA it trusts?)';
  if (tls) return 'the TLS connection failed: the server may require a client certificate (--tls-cert/--tls-key)';
  return 'if the server serves TLS, pass --tls-ca (and --tls-cert/--tls-key if it requires client certificates)';
}

function loadService() {
  const definition = protoLoader.loadSync(PROTO, {
    keepCase: true, // field names as in the proto: token_ids, finish_reason, ...
    longs: Number, // wire_bytes and friends as JSON numbers
    enums: String, // finish_reason as "FINISH_REASON_LENGTH"
    defaults: true, // every stats field present, zeros included
    oneofs: true,
  });
  // The stats' field names in the proto's order (protobufjs would list the repeated ones first).
  const statsFields = definition['specdec.v1.GenerationStats'].type.field.map((field) => field.name);
  return { CoordinatorService: grpc.loadPackageDefinition(definition).specdec.v1.CoordinatorService, statsFields };
}

function ordered(object, keys) {
  const out = {};
  for (const key of keys) if (key in object) out[key] = object[key];
  for (const key of Object.keys(object)) if (!(key in out)) out[key] = object[key];
  return out;
}

function main(argv) {
  let opts;
  let request;
  try {
    opts = parseArgs(argv);
    if (opts.help) {
      process.stdout.write(USAGE + '\n');
      return 0;
    }
    if (!opts.address) throw new UsageError('--address HOST:PORT is required');
    request = buildRequest(opts);
    if (opts.timeout !== undefined) opts.timeoutSeconds = number('timeout', opts.timeout);
    opts.connection = connection(opts);
  } catch (err) {
    if (!(err instanceof UsageError)) throw err;
    process.stderr.write(`error: ${err.message}\n${USAGE}\n`);
    return 2;
  }

  const { CoordinatorService, statsFields } = loadService();
  const { credentials, channelOptions, metadata, tls, clientCert } = opts.connection;
  const client = new CoordinatorService(opts.address, credentials, channelOptions);
  const callOptions = {};
  if (opts.timeoutSeconds !== undefined) callOptions.deadline = Date.now() + 1000 * opts.timeoutSeconds;
  const call = client.GenerateStream(request, metadata, callOptions);
  process.once('SIGINT', () => call.cancel());

  const tokenIds = [];
  let last = null;
  call.on('data', (message) => {
    tokenIds.push(...message.token_ids);
    if (message.text) process.stdout.write(message.text);
    last = message;
  });
  call.on('error', (err) => {
    const name = grpc.status[err.code] || `CODE_${err.code}`;
    const details = String(err.details || '').replace(/\s+/g, ' ').trim();
    const advice = hint(err.code, details, tls, clientCert);
    process.stderr.write(`${name}: ${details}${advice ? ` (${advice})` : ''}\n`);
    process.exitCode = 1;
    client.close();
  });
  call.on('end', () => {
    // 'end' also follows an error on some versions; report only a clean finish.
    if (process.exitCode === 1) return;
    if (last === null || !last.stats) {
      process.stderr.write('INTERNAL: the stream ended without a final message\n');
      process.exitCode = 1;
    } else {
      const summary = { token_ids: tokenIds, finish_reason: last.finish_reason, stats: ordered(last.stats, statsFields) };
      process.stderr.write(JSON.stringify(summary) + '\n');
    }
    client.close();
  });
  return undefined; // the exit code is set when the call ends
}

const code = main(process.argv.slice(2));
if (code !== undefined) process.exitCode = code;
