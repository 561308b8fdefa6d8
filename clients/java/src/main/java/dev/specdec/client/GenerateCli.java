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
import io.grpc.Status;
import io.grpc.StatusRuntimeException;
import java.io.FileDescriptor;
import java.io.FileOutputStream;
import java.io.PrintStream;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Iterator;
import java.util.List;
import java.util.concurrent.TimeUnit;
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
 *        [--draft-length G] [--timeout SECONDS] [--token-ids 1,2,3] ["PROMPT"]
 * </pre>
 *
 * <p>The text goes to stdout (UTF-8) as it streams; at the end one JSON line goes to stderr:
 * {"token_ids": [...], "finish_reason": "FINISH_REASON_LENGTH", "stats": {...}}, with the stats'
 * fields named as in protos/specdec.proto. On a gRPC error it prints "STATUS_NAME: details" to
 * stderr and exits 1; on bad usage it exits 2.
 */
public final class GenerateCli {
  static final String USAGE =
      "usage: run.sh --address HOST:PORT [--max-new-tokens N] [--temperature T]\n"
          + "              [--seed S] [--draft-length G] [--timeout SECONDS] [--token-ids 1,2,3]"
          + " [\"PROMPT\"]\n\n"
          + "Calls specdec.v1.CoordinatorService/GenerateStream and prints the text to stdout as it"
          + " streams,\nthen one JSON line {\"token_ids\", \"finish_reason\", \"stats\"} to stderr.\n"
          + "A prompt is either --token-ids (comma-separated ids in the target's vocabulary) or"
          + " PROMPT text.";

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
    } catch (UsageException e) {
      err.println("error: " + e.getMessage());
      err.println(USAGE);
      return 2;
    }

    ManagedChannel channel = ManagedChannelBuilder.forTarget(options.address).usePlaintext().build();
    List<Integer> tokenIds = new ArrayList<>();
    GenerateStreamResponse last = null;
    try {
      CoordinatorServiceGrpc.CoordinatorServiceBlockingStub stub =
          CoordinatorServiceGrpc.newBlockingStub(channel);
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
      out.flush();
      err.println(status.getCode().name() + ": " + details);
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
