package dev.specdec.client;

import io.netty.buffer.ByteBufAllocator;
import io.netty.handler.codec.http2.Http2SecurityUtil;
import io.netty.handler.ssl.ApplicationProtocolNegotiator;
import io.netty.handler.ssl.JdkApplicationProtocolNegotiator;
import io.netty.handler.ssl.SslContext;
import io.netty.handler.ssl.SslContextBuilder;
import io.netty.handler.ssl.SslProvider;
import io.netty.handler.ssl.SupportedCipherSuiteFilter;
import java.lang.reflect.Constructor;
import java.lang.reflect.InvocationTargetException;
import java.util.List;
import javax.net.ssl.SSLEngine;
import javax.net.ssl.SSLException;
import javax.net.ssl.SSLSessionContext;

/**
 * A client SslContext that negotiates HTTP/2 ("h2") by ALPN with the JDK's own TLS engine.
 *
 * <p>Why: gRPC requires ALPN, and {@code GrpcSslContexts.forClient()} asks Netty for the JDK
 * provider's ALPN support, which Debian's Netty (libnetty-java 4.1.48) removed: building the
 * context fails with "JDK provider does not support ALPN protocol". Java 9 and later negotiate ALPN
 * themselves ({@code SSLParameters.setApplicationProtocols}); Netty's {@code Java9SslEngine}, still
 * in Debian's jar but package-private, sets that up and reports the result where gRPC's TLS handler
 * checks it ({@code SslHandler.applicationProtocol()}). This context wraps each engine of a plain
 * JDK context (no ALPN) in one. {@link GenerateCli} uses it only when the usual way fails, so with
 * an unpatched Netty nothing here runs.
 */
@SuppressWarnings("deprecation") // Netty's negotiator interfaces: deprecated, yet what SslContext returns
final class JdkAlpnSslContext extends SslContext {
  private static final List<String> PROTOCOLS = List.of("h2");

  private final SslContext base;
  private final Constructor<?> java9Engine;
  private final JdkApplicationProtocolNegotiator negotiator = new Negotiator();

  private JdkAlpnSslContext(SslContext base, Constructor<?> java9Engine) {
    this.base = base;
    this.java9Engine = java9Engine;
  }

  /** A client context from a builder holding the trust and key material (nothing else set). */
  static SslContext build(SslContextBuilder builder) throws SSLException {
    Constructor<?> engine;
    try {
      engine =
          Class.forName("io.netty.handler.ssl.Java9SslEngine")
              .getDeclaredConstructor(
                  SSLEngine.class, JdkApplicationProtocolNegotiator.class, boolean.class);
      engine.setAccessible(true);
    } catch (ReflectiveOperationException | RuntimeException e) {
      throw new SSLException("this Netty has no ALPN support for the JDK's TLS engine: " + e, e);
    }
    SslContext base =
        builder
            .sslProvider(SslProvider.JDK)
            .ciphers(Http2SecurityUtil.CIPHERS, SupportedCipherSuiteFilter.INSTANCE)
            .build();
    return new JdkAlpnSslContext(base, engine);
  }

  private SSLEngine wrap(SSLEngine engine) {
    try {
      return (SSLEngine) java9Engine.newInstance(engine, negotiator, false);
    } catch (InvocationTargetException e) {
      throw new IllegalStateException("cannot set up ALPN: " + e.getCause(), e.getCause());
    } catch (ReflectiveOperationException e) {
      throw new IllegalStateException("cannot set up ALPN: " + e, e);
    }
  }

  @Override
  public boolean isClient() {
    return true;
  }

  @Override
  public List<String> cipherSuites() {
    return base.cipherSuites();
  }

  @Override
  public long sessionCacheSize() {
    return base.sessionCacheSize();
  }

  @Override
  public long sessionTimeout() {
    return base.sessionTimeout();
  }

  @Override
  public ApplicationProtocolNegotiator applicationProtocolNegotiator() {
    return negotiator;
  }

  @Override
  public SSLEngine newEngine(ByteBufAllocator alloc) {
    return wrap(base.newEngine(alloc));
  }

  @Override
  public SSLEngine newEngine(ByteBufAllocator alloc, String peerHost, int peerPort) {
    return wrap(base.newEngine(alloc, peerHost, peerPort));
  }

  @Override
  public SSLSessionContext sessionContext() {
    return base.sessionContext();
  }

  /**
   * Offers "h2"; whatever the server picks is left to gRPC, which fails the call unless it is h2.
   */
  private static final class Negotiator implements JdkApplicationProtocolNegotiator {
    @Override
    public List<String> protocols() {
      return PROTOCOLS;
    }

    @Override
    public SslEngineWrapperFactory wrapperFactory() {
      return (engine, negotiator, isServer) -> engine; // the wrapping happens in wrap()
    }

    @Override
    public ProtocolSelectorFactory protocolSelectorFactory() {
      throw new UnsupportedOperationException("a client context selects no protocol");
    }

    @Override
    public ProtocolSelectionListenerFactory protocolListenerFactory() {
      return (engine, protocols) ->
          new ProtocolSelectionListener() {
            @Override
            public void unsupported() {}

            @Override
            public void selected(String protocol) {}
          };
    }
  }
}
