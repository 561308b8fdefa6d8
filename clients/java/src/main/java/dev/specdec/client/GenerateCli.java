package dev.specdec.client;

import com.google.gson.Gson;
import com.google.gson.GsonBuilder;
import com.google.gson.JsonArray;
import com.google.gson.JsonElement;
import com.google.gson.JsonNull;
import com.google.gson.JsonObject;
import com.google.gson.JsonPrimitive;
import com.google.protobuf.Descriptors.EnumValueDescriptor;
import com.google.protobuf.Descriptors.FieldDescriptor;
import com.google.protobuf.Message;
import io.grpc.ManagedChannel;
import io.grpc.ManagedChannelBuilder;
import io.grpc.Metadata;
import io.grpc.Status;
import io.grpc.StatusRuntimeException;
import io.grpc.netty.GrpcSslContexts;
import io.grpc.netty.NettyChannelBuilder;
import io.grpc.stub.MetadataUtils;
import io.netty.handler.ssl.SslContext;
import io.netty.handler.ssl.SslContextBuilder;
import java.io.File;
import java.io.FileDescriptor;
import java.io.FileOutputStream;
import java.io.PrintStream;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Iterator;
import java.util.List;
import java.util.concurrent.TimeUnit;
import javax.net.ssl.SSLException;
import specdec.v1.CoordinatorServiceGrpc;
import specdec.v1.Specdec.GenerateStreamRequest;
import specdec.v1.Specdec.GenerateStreamResponse;
import specdec.v1.Specdec.GenerationStats;
import specdec.v1.Specdec.SamplingParams;
import specdec.v1.Specdec.SpeculationParams;
import specdec.v1.Specdec.TokenIds;

/**
 * Streams a completion from specdec's CoordinatorService.GenerateStream.
 *
 * <pre>
 * run.sh --address HOST:PORT [--max-new-tokens N] [--temperature T] [--seed S]
 *        [--draft-length G] [--timeout SECONDS] [--token-ids 1,2,3]
 *        [--api-token TOKEN] [--tls] [--tls-ca PEM] [--tls-cert PEM --tls-key PEM]
 *        [--tls-server-name NAME] ["PROMPT"]
 * </pre>
 *
 * <p>The API token (default: $SPECDEC_API_TOKEN) goes as {@code authorization: Bearer TOKEN}
 * metadata; any --tls* flag turns TLS on (--tls alone trusts the JVM's CAs).
 *
 * <p>The text goes to stdout (UTF-8) as it streams; at the end one JSON line goes to stderr:
 * {"token_ids": [...], "finish_reason": "FINISH_REASON_LENGTH", "stats": {...}}, with the stats'
 * fields named as in protos/specdec.proto. On a gRPC error it prints "STATUS_NAME: details" to
 * stderr and exits 1; on bad usage it exits 2.
 */
public final class GenerateCli {
  static final String TOKEN_ENV = "SPECDEC_API_TOKEN";

  static final String USAGE =
      "usage: run.sh --address HOST:PORT [--max-new-tokens N] [--temperature T]\n"
          + "              [--seed S] [--draft-length G] [--timeout SECONDS] [--token-ids 1,2,3]\n"
          + "              [--api-token TOKEN] [--tls] [--tls-ca PEM] [--tls-cert PEM --tls-key PEM]\n"
          + "              [--tls-server-name NAME] [\"PROMPT\"]\n\n"
          + "Calls specdec.v1.CoordinatorService/GenerateStream and prints the text to stdout as it"
          + " streams,\nthen one JSON line {\"token_ids\", \"finish_reason\", \"stats\"} to stderr.\n"
          + "A prompt is either --token-ids (comma-separated ids in the target's vocabulary) or"
          + " PROMPT text.\n"
          + "--api-token (default: $" + TOKEN_ENV + ") is sent as `authorization: Bearer TOKEN`"
          + " metadata.\n"
          + "--tls-ca: the CA that signed the coordinator's certificate; --tls-cert/--tls-key: a"
          + " client\ncertificate (mutual TLS; the key in PKCS#8 PEM); --tls-server-name: the name"
          + " to expect in the\nserver's certificate; --tls: TLS trusting the JVM's CAs. Any of them"
          + " turns TLS on.";

  private GenerateCli() {}

  /** A mistake on the command line: exit code 2 with the usage. */
  static final class UsageException extends Exception {
    private static final long serialVersionUID = 1L;

    UsageException(String message) {
      super(message);
    }
  }

  /** The parsed command line. */
  static final class Options {
    boolean help;
    String address;
    String prompt;
    String tokenIds;
    String maxNewTokens;
    String temperature;
    String seed;
    String draftLength;
    String timeout;
    String apiToken;
    boolean tls;
    String tlsCa;
    String tlsCert;
    String tlsKey;
    String tlsServerName;

    static Options parse(String[] args) throws UsageException {
      Options o = new Options();
      List<String> positional = new ArrayList<>();
      for (int i = 0; i < args.length; i++) {
        String arg = args[i];
        if (arg.equals("-h") || arg.equals("--help")) {
          o.help = true;
        } else if (arg.equals("--")) {
          for (int j = i + 1; j < args.length; j++) {
            positional.add(args[j]);
          }
          break;
        } else if (arg.startsWith("--")) {
          int eq = arg.indexOf('=');
          String name = eq >= 0 ? arg.substring(2, eq) : arg.substring(2);
          if (name.equals("tls")) {
            if (eq >= 0) {
              throw new UsageException("--tls takes no value");
            }
            o.tls = true;
            continue;
          }
          String value;
          if (eq >= 0) {
            value = arg.substring(eq + 1);
          } else if (i + 1 < args.length) {
            value = args[++i]; // taken as is, so "--max-new-tokens -1" works
          } else {
            throw new UsageException("--" + name + " needs a value");
          }
          switch (name) {
            case "address": o.address = value; break;
            case "max-new-tokens": o.maxNewTokens = value; break;
            case "temperature": o.temperature = value; break;
            case "seed": o.seed = value; break;
            case "draft-length": o.draftLength = value; break;
            case "token-ids": o.tokenIds = value; break;
            case "timeout": o.timeout = value; break;
            case "api-token": o.apiToken = value; break;
            case "tls-ca": o.tlsCa = value; break;
            case "tls-cert": o.tlsCert = value; break;
            case "tls-key": o.tlsKey = value; break;
            case "tls-server-name": o.tlsServerName = value; break;
            default: throw new UsageException("unknown option --" + name);
          }
        } else {
          positional.add(arg);
        }
      }
      if (positional.size() > 1) {
        throw new UsageException("give one PROMPT (quote it)");
      }
      o.prompt = positional.isEmpty() ? null : positional.get(0);
      return o;
    }

    GenerateStreamRequest toRequest() throws UsageException {
      GenerateStreamRequest.Builder request = GenerateStreamRequest.newBuilder();
      if (tokenIds != null) {
        if (prompt != null) {
          throw new UsageException("give either --token-ids or PROMPT, not both");
        }
        TokenIds.Builder ids = TokenIds.newBuilder();
        String text = tokenIds.trim();
        if (!text.isEmpty()) {
          for (String part : text.split(",", -1)) {
            ids.addIds(parseInt("token-ids", part));
          }
        }
        request.setTokenIds(ids);
      } else if (prompt != null) {
        request.setText(prompt);
      } else {
        throw new UsageException("a prompt is required: PROMPT or --token-ids");
      }
      if (maxNewTokens != null) {
        request.setMaxNewTokens(parseInt("max-new-tokens", maxNewTokens));
      }
      if (temperature != null || seed != null) {
        SamplingParams.Builder sampling = SamplingParams.newBuilder();
        if (temperature != null) {
          sampling.setTemperature((float) parseNumber("temperature", temperature));
        }
        if (seed != null) {
          try {
            sampling.setSeed(Long.parseUnsignedLong(seed.trim()));
          } catch (NumberFormatException e) {
            throw new UsageException("--seed must be a non-negative integer, got \"" + seed + "\"");
          }
        }
        request.setSampling(sampling);
      }
      if (draftLength != null) {
        request.setSpeculation(
            SpeculationParams.newBuilder().setDraftLength(parseInt("draft-length", draftLength)));
      }
      return request.build();
    }

    Double timeoutSeconds() throws UsageException {
      return timeout == null ? null : parseNumber("timeout", timeout);
    }

    boolean tlsOn() {
      return tls || tlsCa != null || tlsCert != null || tlsServerName != null;
    }

    /** Every call's metadata: the bearer token (--api-token, else $SPECDEC_API_TOKEN), if any. */
    Metadata headers() throws UsageException {
      String token = apiToken != null ? apiToken : System.getenv(TOKEN_ENV);
      token = token == null ? "" : token.trim();
      if (!token.matches("[\\x21-\\x7e]*")) {
        throw new UsageException(
            "--api-token: only printable ASCII without spaces can travel in an `authorization`"
                + " header");
      }
      Metadata headers = new Metadata();
      if (!token.isEmpty()) {
        headers.put(
            Metadata.Key.of("authorization", Metadata.ASCII_STRING_MARSHALLER), "Bearer " + token);
      }
      return headers;
    }

    /** The channel: plaintext, or TLS with --tls-ca (else the JVM's CAs) and a client certificate. */
    ManagedChannel channel() throws UsageException {
      if ((tlsCert == null) != (tlsKey == null)) {
        throw new UsageException("--tls-cert and --tls-key go together");
      }
      if (!tlsOn()) {
        return ManagedChannelBuilder.forTarget(address).usePlaintext().build();
      }
      try {
        NettyChannelBuilder builder = NettyChannelBuilder.forTarget(address).sslContext(sslContext());
        if (tlsServerName != null) {
          builder.overrideAuthority(tlsServerName); // the name checked in the server's certificate
        }
        return builder.build();
      } catch (SSLException | IllegalArgumentException e) {
        Throwable cause = e.getCause() != null ? e.getCause() : e;
        throw new UsageException(
            "cannot use the TLS files (--tls-ca, --tls-cert, --tls-key; the key must be PKCS#8 PEM):"
                + " " + cause.getMessage());
      }
    }

    /**
     * gRPC's own TLS context; on Debian's Netty, which lacks the JDK ALPN support that one needs,
     * the same from {@link JdkAlpnSslContext}.
     */
    SslContext sslContext() throws UsageException, SSLException {
      try {
        return withKeys(GrpcSslContexts.forClient()).build();
      } catch (UnsupportedOperationException | IllegalStateException e) {
        return JdkAlpnSslContext.build(withKeys(SslContextBuilder.forClient()));
      }
    }

    /** --tls-ca to trust (else the JVM's CAs) and the client certificate, if any. */
    SslContextBuilder withKeys(SslContextBuilder ssl) throws UsageException {
      if (tlsCa != null) {
        ssl.trustManager(readable("tls-ca", tlsCa));
      }
      if (tlsCert != null) {
        ssl.keyManager(readable("tls-cert", tlsCert), readable("tls-key", tlsKey));
      }
      return ssl;
    }
  }

  static File readable(String flag, String path) throws UsageException {
    File file = new File(path);
    if (!file.isFile() || !file.canRead()) {
      throw new UsageException("--" + flag + ": cannot read \"" + path + "\"");
    }
    return file;
  }

  /** What to do about a failed call, or "" (the same advice as `specdec generate`). */
  static String hint(Status status, boolean tls, boolean clientCert) {
    StringBuilder text = new StringBuilder(String.valueOf(status.getDescription()));
    for (Throwable c = status.getCause(); c != null && text.length() < 4096; c = c.getCause()) {
      text.append(' ').append(c);
      if (c.getCause() == c) {
        break;
      }
    }
    String details = text.toString();
    switch (status.getCode()) {
      case UNAUTHENTICATED:
        return "the coordinator requires an API token: pass --api-token or set $" + TOKEN_ENV;
      case PERMISSION_DENIED:
        return "the coordinator rejected the API token: check --api-token / $" + TOKEN_ENV;
      case UNAVAILABLE:
        break;
      default:
        return "";
    }
    if (details.contains("NotSslRecordException") || details.contains("not an SSL/TLS record")) {
      return "the server does not speak TLS: drop --tls and the --tls-* flags";
    }
    if (details.contains("PKIX") || details.contains("certificat") || details.contains("trust anchor")
        || details.contains("subject alternative")) {
      return "the server's certificate is not trusted or does not name the host: check --tls-ca"
          + " and --tls-server-name";
    }
    if (details.contains("Connection refused")) {
      return "nothing listens there: start a coordinator or check --address";
    }
    // A server that hangs up during set-up: TLS against plaintext, or a client certificate missing
    // or refused.
    if (clientCert) {
      return "the TLS connection failed: the server may not accept --tls-cert (not signed by the CA"
          + " it trusts?)";
    }
    if (tls) {
      return "the TLS connection failed: the server may require a client certificate"
          + " (--tls-cert/--tls-key)";
    }
    return "if the server serves TLS, pass --tls-ca (and --tls-cert/--tls-key if it requires client"
        + " certificates)";
  }

  static int parseInt(String name, String value) throws UsageException {
    try {
      return Integer.parseInt(value.trim());
    } catch (NumberFormatException e) {
      throw new UsageException("--" + name + " must be an integer, got \"" + value + "\"");
    }
  }

  static double parseNumber(String name, String value) throws UsageException {
    try {
      return Double.parseDouble(value.trim());
    } catch (NumberFormatException e) {
      throw new UsageException("--" + name + " must be a number, got \"" + value + "\"");
    }
  }

  /** A protobuf field value as JSON, the field named as in the proto (proto-loader's keepCase). */
  static JsonElement toJson(FieldDescriptor field, Object value) {
    if (field.isRepeated()) {
      JsonArray array = new JsonArray();
      for (Object item : (List<?>) value) {
        array.add(scalarToJson(field, item));
      }
      return array;
    }
    return scalarToJson(field, value);
  }

  static JsonElement scalarToJson(FieldDescriptor field, Object value) {
    switch (field.getJavaType()) {
      case MESSAGE:
        return messageToJson((Message) value);
      case ENUM:
        return new JsonPrimitive(((EnumValueDescriptor) value).getName());
      case FLOAT:
        // As a double, so 0.6 prints as 0.6000000238418579: the float's exact value, as Node does.
        return new JsonPrimitive(((Float) value).doubleValue());
      case LONG:
        long v = (Long) value;
        boolean unsigned =
            field.getType() == FieldDescriptor.Type.UINT64
                || field.getType() == FieldDescriptor.Type.FIXED64;
        return unsigned && v < 0
            ? new JsonPrimitive(new java.math.BigInteger(Long.toUnsignedString(v)))
            : new JsonPrimitive(v);
      case INT:
      case DOUBLE:
        return new JsonPrimitive((Number) value);
      case BOOLEAN:
        return new JsonPrimitive((Boolean) value);
      case STRING:
        return new JsonPrimitive((String) value);
      default:
        return value == null ? JsonNull.INSTANCE : new JsonPrimitive(value.toString());
    }
  }

  /** Every field, defaults included, in declaration order. */
  static JsonObject messageToJson(Message message) {
    JsonObject json = new JsonObject();
    for (FieldDescriptor field : message.getDescriptorForType().getFields()) {
      json.add(field.getName(), toJson(field, message.getField(field)));
    }
    return json;
  }

  public static void main(String[] args) {
    System.exit(run(args));
  }

  static int run(String[] args) {
    // UTF-8 whatever the locale: the generated text is arbitrary Unicode.
    PrintStream out =
        new PrintStream(new FileOutputStream(FileDescriptor.out), false, StandardCharsets.UTF_8);
    PrintStream err =
        new PrintStream(new FileOutputStream(FileDescriptor.err), true, StandardCharsets.UTF_8);
    Options options;
    GenerateStreamRequest request;
    Double timeoutSeconds;
    Metadata headers;
    ManagedChannel channel;
    try {
      options = Options.parse(args);
      if (options.help) {
        out.println(USAGE);
        out.flush();
        return 0;
      }
      if (options.address == null) {
        throw new UsageException("--address HOST:PORT is required");
      }
      request = options.toRequest();
      timeoutSeconds = options.timeoutSeconds();
      headers = options.headers();
      channel = options.channel();
    } catch (UsageException e) {
      err.println("error: " + e.getMessage());
      err.println(USAGE);
      return 2;
    }

    List<Integer> tokenIds = new ArrayList<>();
    GenerateStreamResponse last = null;
    try {
      CoordinatorServiceGrpc.CoordinatorServiceBlockingStub stub =
          CoordinatorServiceGrpc.newBlockingStub(channel)
              .withInterceptors(MetadataUtils.newAttachHeadersInterceptor(headers));
      if (timeoutSeconds != null) {
        stub = stub.withDeadlineAfter((long) (timeoutSeconds * 1e9), TimeUnit.NANOSECONDS);
      }
      Iterator<GenerateStreamResponse> stream = stub.generateStream(request);
      while (stream.hasNext()) {
        last = stream.next();
        tokenIds.addAll(last.getTokenIdsList());
        if (!last.getText().isEmpty()) {
          out.print(last.getText());
          out.flush();
        }
      }
    } catch (StatusRuntimeException e) {
      Status status = e.getStatus();
      String details = status.getDescription() == null ? "" : status.getDescription();
      Throwable cause = status.getCause();
      while (cause != null && cause.getCause() != null && cause.getCause() != cause) {
        cause = cause.getCause();
      }
      if (cause != null && cause.getMessage() != null) {
        details += ": " + cause.getMessage(); // "io exception" alone says nothing
      }
      // Netty's pipeline listing says nothing to a user.
      details = details.replaceAll("\\s*Channel Pipeline: \\[[^\\]]*\\]", "").replaceAll("\\s+", " ");
      String advice = hint(status, options.tlsOn(), options.tlsCert != null);
      out.flush();
      err.println(
          status.getCode().name() + ": " + details + (advice.isEmpty() ? "" : " (" + advice + ")"));
      return 1;
    } finally {
      out.flush();
      channel.shutdownNow();
      try {
        channel.awaitTermination(5, TimeUnit.SECONDS);
      } catch (InterruptedException e) {
        Thread.currentThread().interrupt();
      }
    }
    if (last == null || !last.hasStats()) {
      err.println("INTERNAL: the stream ended without a final message");
      return 1;
    }
    JsonObject summary = new JsonObject();
    JsonArray ids = new JsonArray();
    tokenIds.forEach(ids::add);
    summary.add("token_ids", ids);
    summary.addProperty("finish_reason", last.getFinishReason().name());
    GenerationStats stats = last.getStats();
    summary.add("stats", messageToJson(stats));
    Gson gson = new GsonBuilder().disableHtmlEscaping().serializeSpecialFloatingPointValues().create();
    err.println(gson.toJson(summary));
    return 0;
  }
}
